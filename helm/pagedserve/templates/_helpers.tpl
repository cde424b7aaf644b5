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

{{/* serveConfigV2: one application whose args are exactly the `server:` values. */}}
{{- define "pagedserve.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
applications:
  - name: pagedserve
    route_prefix: /
    import_path: pagedserve.cluster.app:build_app
    args:
      {{- toYaml .Values.server | nindent 6 }}
{{- end -}}

{{/* Environment of every Ray container: secrets by reference only, never their values. */}}
{{- define "pagedserve.env" -}}
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

{{/* Stop Ray cleanly before the pod goes (KubeRay's samples do the same). */}}
{{- define "pagedserve.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      command: ["/bin/sh", "-c", "ray stop"]
{{- end -}}

{{/* rayStartParams as KubeRay wants them: every value a string. */}}
{{- define "pagedserve.rayStartParams" -}}
{{- $params := dict -}}
{{- range $name, $value := . -}}
{{- $_ := set $params $name (toString $value) -}}
{{- end -}}
{{- toYaml $params -}}
{{- end -}}
