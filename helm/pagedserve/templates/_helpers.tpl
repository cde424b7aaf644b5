{{/* Names and labels, as `helm create` makes them. */}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "pagedserve.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pagedserve.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The Service in front of Serve's proxies (KubeRay fills its selector). */}}
{{- define "pagedserve.serveServiceName" -}}
{{- printf "%s-serve" (include "pagedserve.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Total GPUs the worker groups can ever have: sum of gpus x maxReplicas. */}}
{{- define "pagedserve.gpuCapacity" -}}
{{- $total := 0 -}}
{{- range .Values.workerGroups -}}
{{- $total = add $total (mul (int (default 0 .gpus)) (int .maxReplicas)) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{- define "pagedserve.image" -}}
{{- $variant := ternary "cuda" "cpu" (gt (int (include "pagedserve.gpuCapacity" .)) 0) -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* serveConfigV2: one application whose args are the `server:` values except the replica count,
which goes in Serve's `deployments:` override (as pagedserve.cluster.app.serve_application_config
writes it): Serve restarts every replica of an app whose args change, while a changed override
only starts or stops the replicas added or removed. */}}
{{- define "pagedserve.serveConfig" -}}
{{- $server := deepCopy .Values.server -}}
{{- $deployment := default dict $server.deployment -}}
{{- $scale := include "pagedserve.scale" $deployment | fromYaml -}}
{{- range list "num_replicas" "autoscaling" "autoscaling_config" -}}
{{- $_ := unset $deployment . -}}
{{- end -}}
{{- if $deployment -}}
{{- $_ := set $server "deployment" $deployment -}}
{{- else -}}
{{- $_ := unset $server "deployment" -}}
{{- end -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
applications:
  - name: pagedserve
    route_prefix: /
    import_path: pagedserve.cluster.app:build_app
    args:
      {{- toYaml $server | nindent 6 }}
    deployments:
      - name: LLMServer
        {{- toYaml $scale | nindent 8 }}
      {{- if .Values.workerGroups }}
      {{- range list "OpenAIIngress" "MetricsHub" }}
      - name: {{ . }}
        ray_actor_options:
          num_cpus: 0
          resources: {{ printf "{%q: %s}" (include "pagedserve.frontendResource" $) (include "pagedserve.frontendDemand" $) }}
          {{- if eq . "OpenAIIngress" }}
          {{- /* These options replace the code's, so they repeat its environment: the ingress takes
          answers past gRPC's default 4 MiB (serve_engine_client.ingress_env_vars). */}}
          runtime_env:
            env_vars:
              RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH: "2147483647"
          {{- end }}
      {{- end }}
      {{- end }}
{{- end -}}

{{/* The Ray resource that keeps the ingress and the metrics hub off the head: only worker pods
advertise it (frontendSlots each), and each of the two deployments' replicas takes frontendDemand
of it. The head pod is small and hosts the GCS: a tokenizer load or a huge prompt in the ingress
must not run it out of memory. Without worker groups the head runs everything and nothing asks. */}}
{{- define "pagedserve.frontendResource" -}}pagedserve_frontend{{- end -}}
{{- define "pagedserve.frontendSlots" -}}1000{{- end -}}
{{- define "pagedserve.frontendDemand" -}}1{{- end -}}

{{/* The Secret holding the Ray cluster's token (key auth_token): the user's or the chart's. */}}
{{- define "pagedserve.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "pagedserve.fullname" .) | trunc 63 | trimSuffix "-") .Values.rayAuth.secretName -}}
{{- end -}}

{{/* The LLMServer's Serve scale options from server.deployment (DeploymentConfig.serve_scaling_options):
`autoscaling` becomes Serve's autoscaling_config with pagedserve's engine-load policy; the
defaults are AutoscalingConfig's (tests/helm checks the two agree). */}}
{{- define "pagedserve.scale" -}}
{{- if .autoscaling -}}
{{- $given := .autoscaling -}}
{{- $settings := dict "min_replicas" 1 "max_replicas" 4 "upscale_delay_s" 15.0 "downscale_delay_s" 300.0 "look_back_period_s" 10.0 "metrics_interval_s" 2.0 -}}
{{- $targets := dict "target_waiting_per_replica" 2.0 "target_kv_usage" 0.8 "target_batch_usage" 1.0 -}}
{{- range $name, $value := $given -}}
{{- if hasKey $targets $name -}}{{- $_ := set $targets $name $value -}}{{- else -}}{{- $_ := set $settings $name $value -}}{{- end -}}
{{- end -}}
{{- $_ := set $settings "policy" (dict "policy_function" "pagedserve.cluster.autoscaling:EngineLoadPolicy" "policy_kwargs" $targets) -}}
{{- toYaml (dict "autoscaling_config" $settings) -}}
{{- else if .autoscaling_config -}}
{{- toYaml (dict "autoscaling_config" .autoscaling_config) -}}
{{- else -}}
{{- toYaml (dict "num_replicas" (default 1 .num_replicas)) -}}
{{- end -}}
{{- end -}}

{{/* Environment of every Ray container: secrets by reference only, never their values. */}}
{{- define "pagedserve.env" -}}
{{- /* Ray would start its workers (the Serve replicas, the engine) at nice 15, where the raylet,
the GCS or any nice-0 process in the pod takes a core they both want almost wholly: at the
raylet's own niceness. */}}
- name: RAY_worker_niceness
  value: "0"
{{- if eq .Values.rayAuth.mode "token" }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pagedserve.rayTokenSecretName" . }}
      key: auth_token
{{- end }}
{{- if .Values.apiKey.secretName }}
- name: PAGEDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.secretName }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- if .Values.hfToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.secretName }}
      key: {{ .Values.hfToken.secretKey }}
{{- end }}
{{- end -}}

{{- define "pagedserve.modelVolume" -}}
{{- if .Values.model.persistentVolumeClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.persistentVolumeClaim }}
    readOnly: true
{{- else if .Values.model.hostPath }}
- name: models
  hostPath:
    path: {{ .Values.model.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "pagedserve.modelMount" -}}
{{- if or .Values.model.persistentVolumeClaim .Values.model.hostPath }}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Before the pod goes: SIGTERM this node's LLMServer replicas, which hand their streams over
to replicas on other nodes and exit (pagedserve.cluster.node_drain, waiting up to the drain
timeout and a margin), then stop Ray cleanly (KubeRay's samples do that last step too). */}}
{{- define "pagedserve.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      command: ["/bin/sh", "-c", {{ printf "python -m pagedserve.cluster.node_drain --timeout-s %d; ray stop" (include "pagedserve.drainWaitSeconds" . | int) | quote }}]
{{- end -}}

{{/* How long the preStop hook waits for the replicas' drain: server.drain_timeout_s plus a margin. */}}
{{- define "pagedserve.drainWaitSeconds" -}}
{{- $server := .Values.server -}}
{{- $drain := 20.0 -}}
{{- if hasKey $server "drain_timeout_s" -}}{{- $drain = float64 $server.drain_timeout_s -}}{{- end -}}
{{- add (int (ceil $drain)) 10 -}}
{{- end -}}

{{/* The pod's grace period: the preStop hook's wait, then `ray stop` (about 30 s at most). */}}
{{- define "pagedserve.terminationGracePeriodSeconds" -}}
terminationGracePeriodSeconds: {{ add (include "pagedserve.drainWaitSeconds" . | int) 30 }}
{{- end -}}

{{/* rayStartParams as KubeRay wants them: every value a string. */}}
{{- define "pagedserve.rayStartParams" -}}
{{- $params := dict -}}
{{- range $name, $value := . -}}
{{- $_ := set $params $name (toString $value) -}}
{{- end -}}
{{- toYaml $params -}}
{{- end -}}
