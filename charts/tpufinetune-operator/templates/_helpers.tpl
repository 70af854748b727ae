{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "tpuft.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: <release>-<chart> unless the release name already contains the chart name. */}}
{{- define "tpuft.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tpuft.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tpuft.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tpuft.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object, without app.kubernetes.io/component. */}}
{{- define "tpuft.commonLabels" -}}
helm.sh/chart: {{ include "tpuft.chart" . }}
{{ include "tpuft.selectorLabels" . }}
app.kubernetes.io/part-of: tpufinetune
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tpuft.labels" -}}
{{ include "tpuft.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "tpuft.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tpuft.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tpuft.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Validated list of watched namespaces (empty list = cluster-wide). */}}
{{- define "tpuft.watchNamespaces" -}}
{{- $seen := dict -}}
{{- range .Values.watchNamespaces -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .) -}}
{{- fail (printf "watchNamespaces: %q is not a valid namespace name (kopf globs/negations are not supported by this chart: RBAC needs exact names)" .) -}}
{{- end -}}
{{- if hasKey $seen . -}}
{{- fail (printf "watchNamespaces: %q is listed twice" .) -}}
{{- end -}}
{{- $_ := set $seen . true -}}
{{- end -}}
{{- end -}}

{{- define "tpuft.logLevel" -}}
{{- $l := lower (toString .Values.logLevel) -}}
{{- if not (has $l (list "debug" "info" "warning")) -}}
{{- fail (printf "logLevel must be one of debug, info, warning (got %q)" .Values.logLevel) -}}
{{- end -}}
{{- $l -}}
{{- end -}}
