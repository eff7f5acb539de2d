{{/* Labels of every object of the release. */}}
{{- define "splitserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The serve values, as JSON: `splitserve` (the serve config) and `autoscalingPolicy`
from the values given, else from serve-values.yaml. */}}
{{- define "splitserve.serveValues" -}}
{{- if .Values.splitserve }}
{{- dict "splitserve" .Values.splitserve "autoscalingPolicy" .Values.autoscalingPolicy | toJson }}
{{- else }}
{{- .Files.Get "serve-values.yaml" | fromYaml | toJson }}
{{- end }}
{{- end }}

{{/* The environment of every Ray container: http.proxy haproxy (the default) runs
Ray Serve's HAProxy mode, read when Ray starts. */}}
{{- define "splitserve.rayEnv" -}}
{{- $http := (include "splitserve.serveValues" . | fromJson).splitserve.http | default dict }}
{{- if eq ($http.proxy | default "haproxy") "haproxy" }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "1"
{{- end }}
{{- end }}

{{/* The Ray Serve config file (serveConfigV2): the serve config is the one
application's args, built by splitserve.cluster.app:app_builder as `splitserve serve`
builds it; `splitserve render --target serve-config` writes the same file. */}}
{{- define "splitserve.serveConfig" -}}
{{- $values := include "splitserve.serveValues" . | fromJson }}
{{- $ss := $values.splitserve }}
{{- $app := dict "name" ($ss.app_name | default "splitserve") "route_prefix" "/" "import_path" "splitserve.cluster.app:app_builder" "args" $ss }}
{{- with $values.autoscalingPolicy }}
{{- $_ := set $app "autoscaling_policy" . }}
{{- end }}
{{- $http := dict "host" $ss.host "port" ($ss.port | default 8000) }}
{{- toYaml (dict "proxy_location" "EveryNode" "http_options" $http "applications" (list $app)) }}
{{- end }}
