{{/* Combinations that could never run fail the render, naming what is wrong. */}}
{{- define "pagedserve.validate" -}}
{{- $server := .Values.server -}}
{{- $engine := default dict $server.engine -}}
{{- $deployment := default dict $server.deployment -}}
{{- if $server.api_key -}}
{{- fail "server.api_key must not be given in plain text: create a Secret and set apiKey.secretName (and apiKey.secretKey); the key reaches the server as PAGEDSERVE_API_KEY" -}}
{{- end -}}
{{- $exposed := "" -}}
{{- if .Values.ingress.enabled -}}{{- $exposed = "ingress.enabled" -}}
{{- else if has .Values.service.type (list "NodePort" "LoadBalancer") -}}{{- $exposed = printf "service.type %s" .Values.service.type -}}
{{- end -}}
{{- if and $exposed (not .Values.apiKey.secretName) -}}
{{- fail (printf "%s exposes the server outside the cluster, but no API key is set: create a Secret (kubectl create secret generic pagedserve-api-key --from-literal=api-key=$(openssl rand -hex 24)) and set apiKey.secretName=pagedserve-api-key" $exposed) -}}
{{- end -}}
{{- if and (ne .Values.rayAuth.mode "token") (not .Values.rayAuth.allowUnauthenticated) -}}
{{- fail "rayAuth.mode is \"disabled\": anyone who reaches the Ray ports (dashboard 8265, client 10001, GCS 6379) could run code on every pod; keep rayAuth.mode=token, or set rayAuth.allowUnauthenticated=true to accept that" -}}
{{- end -}}
{{- if eq (toString $server.http_ingress) "direct" -}}
{{- fail "server.http_ingress is \"direct\", which only `pagedserve serve` on a Ray cluster it starts can set up; here Serve's proxy on each pod answers the Service's port 8000: leave it auto (or proxy)" -}}
{{- end -}}
{{- if eq (toString $server.engine_host) "ingress" -}}
{{- fail "server.engine_host is \"ingress\", but on KubeRay the engine runs in the LLMServer deployment the chart scales and drains (serveConfigV2's deployments:); leave it auto (or replicas)" -}}
{{- end -}}
{{- if and .Values.model.persistentVolumeClaim .Values.model.hostPath -}}
{{- fail "model.persistentVolumeClaim and model.hostPath are both set: give one of them" -}}
{{- end -}}
{{- $capacity := int (include "pagedserve.gpuCapacity" .) -}}
{{- $device := toString (default "auto" $engine.device) -}}
{{- if and (eq $device "cuda") (eq $capacity 0) -}}
{{- fail "server.engine.device is \"cuda\" but no worker group has GPUs: set gpus (and maxReplicas) on a workerGroups entry" -}}
{{- end -}}
{{- if and (gt $capacity 0) (ne $device "cpu") -}}
{{- $world := mul (int (default 1 $engine.tensor_parallel_size)) (int (default 1 $engine.pipeline_parallel_size)) -}}
{{- $replicas := int (default 1 $deployment.num_replicas) -}}
{{- $source := "server.deployment.num_replicas" -}}
{{- if $deployment.autoscaling_config -}}
{{- $replicas = int (default 1 $deployment.autoscaling_config.max_replicas) -}}
{{- $source = "server.deployment.autoscaling_config.max_replicas" -}}
{{- else if $deployment.autoscaling -}}
{{- $replicas = int (default 4 $deployment.autoscaling.max_replicas) -}}
{{- $source = "server.deployment.autoscaling.max_replicas" -}}
{{- end -}}
{{- $needed := mul $world $replicas -}}
{{- if gt $needed $capacity -}}
{{- fail (printf "tensor_parallel_size x pipeline_parallel_size = %d GPUs per replica x %d replicas (%s) needs %d GPUs, but the worker groups can have at most %d (the sum of gpus x maxReplicas)" $world $replicas $source $needed $capacity) -}}
{{- end -}}
{{- end -}}
{{- range .Values.workerGroups -}}
{{- if gt (int .minReplicas) (int .maxReplicas) -}}
{{- fail (printf "workerGroups %q: minReplicas (%d) exceeds maxReplicas (%d)" .name (int .minReplicas) (int .maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int .replicas) (int .minReplicas)) (gt (int .replicas) (int .maxReplicas)) -}}
{{- fail (printf "workerGroups %q: replicas (%d) must be between minReplicas (%d) and maxReplicas (%d)" .name (int .replicas) (int .minReplicas) (int .maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- $grace := 30 -}}
{{- if hasKey $server "graceful_shutdown_s" -}}{{- $grace = $server.graceful_shutdown_s -}}{{- end -}}
{{- if lt (float64 .Values.rayClusterDeletionDelaySeconds) (float64 $grace) -}}
{{- fail (printf "rayClusterDeletionDelaySeconds (%v) is shorter than server.graceful_shutdown_s (%v): the old cluster would be deleted while its requests still drain" .Values.rayClusterDeletionDelaySeconds $grace) -}}
{{- end -}}
{{- end -}}
