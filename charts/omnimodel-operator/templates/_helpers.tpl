{{/*
Expand the name of the chart.
*/}}
{{- define "omnimodel-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "omnimodel-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "omnimodel-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels naming the release, without app.kubernetes.io/name: the CRD keeps its own name label.
*/}}
{{- define "omnimodel-operator.releaseLabels" -}}
helm.sh/chart: {{ include "omnimodel-operator.chart" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "omnimodel-operator.labels" -}}
helm.sh/chart: {{ include "omnimodel-operator.chart" . }}
{{ include "omnimodel-operator.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: omnimodel
{{- end }}

{{/*
Labels of the `helm test` Job and its pod: not the operator's selector labels, so that the test pod
never looks like an operator pod.
*/}}
{{- define "omnimodel-operator.testLabels" -}}
{{ include "omnimodel-operator.releaseLabels" . }}
app.kubernetes.io/name: {{ include "omnimodel-operator.name" . }}-test
app.kubernetes.io/component: test
app.kubernetes.io/part-of: omnimodel
{{- end }}

{{/*
Selector labels
*/}}
{{- define "omnimodel-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omnimodel-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The metrics Service: the full name plus `-metrics`, cut so that the whole stays a valid Service name
(63 characters).
*/}}
{{- define "omnimodel-operator.metricsServiceName" -}}
{{- printf "%s-metrics" (include "omnimodel-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/*
OMNIMODEL_METRICS_PORT: the metrics port, or 0 (the operator's "serve no metrics") when disabled.
*/}}
{{- define "omnimodel-operator.metricsPort" -}}
{{- if .Values.metrics.enabled }}
{{- if eq (int .Values.metrics.port) (int .Values.operator.healthPort) }}
{{- fail (printf "metrics.port and operator.healthPort are both %d: the metrics endpoint and kopf's liveness endpoint need a port each" (int .Values.metrics.port)) }}
{{- end }}
{{- .Values.metrics.port | int }}
{{- else }}
{{- 0 }}
{{- end }}
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "omnimodel-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "omnimodel-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image: repository:tag, or repository@digest when a digest pins it.
*/}}
{{- define "omnimodel-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Runtime image variant per accelerator vendor whose image this project publishes: the image_variant
column of omnimodel_operator/accelerators.py where has_runtime_image is true (a unit test keeps the two
equal). Intel (xpu) and Ascend (cann) have no Dockerfile, so no image to default to.
*/}}
{{- define "omnimodel-operator.runtimeVariants" -}}
{{- dict "nvidia" "cuda" "amd" "rocm" "cpu" "cpu" | toJson }}
{{- end }}

{{/*
Every accelerator vendor the operator knows (runtime.images may name any of them).
*/}}
{{- define "omnimodel-operator.runtimeVendors" -}}
{{- list "amd" "ascend" "cpu" "intel" "nvidia" | toJson }}
{{- end }}

{{/*
OMNIMODEL_RUNTIME_IMAGES: a JSON object vendor → image. The default for a vendor with a published image
is <runtime.repository>:<runtime.tag or appVersion>-<variant>, exactly what the operator would pick
itself (omnimodel_operator.settings.DEFAULT_RUNTIME_IMAGES); runtime.images replaces or adds single
vendors. A vendor left out (intel, ascend unless runtime.images names them) gets no image: the operator
refuses its stages with InvalidSpec instead of rendering pods that could never pull.
*/}}
{{- define "omnimodel-operator.runtimeImages" -}}
{{- $tag := .Values.runtime.tag | default .Chart.AppVersion }}
{{- $vendors := include "omnimodel-operator.runtimeVendors" . | fromJsonArray }}
{{- $images := dict }}
{{- range $vendor, $variant := include "omnimodel-operator.runtimeVariants" . | fromJson }}
{{- $_ := set $images $vendor (printf "%s:%s-%s" $.Values.runtime.repository $tag $variant) }}
{{- end }}
{{- range $vendor, $image := .Values.runtime.images }}
{{- if not (has $vendor $vendors) }}
{{- fail (printf "runtime.images: unknown accelerator vendor %q (known: %s)" $vendor (join ", " $vendors)) }}
{{- end }}
{{- $_ := set $images $vendor $image }}
{{- end }}
{{- $images | toJson }}
{{- end }}

{{/*
Whether this release installs and upgrades the OmniModel CRD: crds.enabled, and the CRD is not already
there under another owner. One CRD serves every release in a cluster; a second release (another
namespace, other watchNamespaces) leaves it to the release that has it, instead of failing on Helm's
ownership check. `helm template` cannot look (no cluster) and renders it.
*/}}
{{- define "omnimodel-operator.managesCrd" -}}
{{- if .Values.crds.enabled -}}
{{- $crd := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "omnimodels.omnimodel.io" | default dict -}}
{{- $annotations := dig "metadata" "annotations" dict $crd -}}
{{- if or (not $crd) (and (eq (get $annotations "meta.helm.sh/release-name") .Release.Name) (eq (get $annotations "meta.helm.sh/release-namespace") .Release.Namespace)) -}}
true
{{- end -}}
{{- end -}}
{{- end }}

{{/*
The kopf peering object's name (ClusterKopfPeering, or KopfPeering in each watched namespace): prefixed
with the release namespace like the ClusterRole, so that two releases never share one and pause each other.
*/}}
{{- define "omnimodel-operator.peeringName" -}}
{{- include "omnimodel-operator.clusterRoleName" . }}
{{- end }}

{{/*
"true" when this render's operator pods can meet the running operator in a peering object: peering
is on, and the Deployment is new or one of the peering objects it announces itself in already exists.
Not so when the running operator is standalone (peering was off, or a chart without peering) or
announces itself elsewhere (watchNamespaces switched between empty and listed, or to disjoint
namespaces): the old and new pod would not see each other, so that one rollout is Recreate.
`helm template` cannot look (no cluster) and renders the rolling strategy.
*/}}
{{- define "omnimodel-operator.rolling" -}}
{{- if .Values.peering.enabled -}}
{{- $name := include "omnimodel-operator.peeringName" . -}}
{{- $deployment := lookup "apps/v1" "Deployment" .Release.Namespace (include "omnimodel-operator.fullname" .) -}}
{{- $met := not $deployment -}}
{{- if .Values.watchNamespaces -}}
{{- range .Values.watchNamespaces -}}
{{- if lookup "kopf.dev/v1" "KopfPeering" . $name -}}{{- $met = true -}}{{- end -}}
{{- end -}}
{{- else if lookup "kopf.dev/v1" "ClusterKopfPeering" "" $name -}}
{{- $met = true -}}
{{- end -}}
{{- if $met -}}true{{- end -}}
{{- end -}}
{{- end }}
