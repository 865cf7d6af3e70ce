{{/*
RBAC rules: exactly the kinds and verbs the operator uses (omnimodel_operator/reconcile.py, handlers.py) plus what kopf itself needs (https://kopf.readthedocs.io/en/stable/deployment/), each
commented with its purpose. No wildcards. Secrets: `get` only, to say in status which Secret an OmniModel
names and lacks; their data is never listed or watched. tests/component/chart checks these rules against that list.
*/}}

{{/*
Rules for the namespaces the operator reconciles: a ClusterRole in cluster-wide mode, a Role in each of
watchNamespaces otherwise.
*/}}
{{- define "omnimodel-operator.rbac.namespacedRules" -}}
# OmniModels: kopf lists and watches them to feed the controller's cache and queue. The operator
# writes nothing to them but their status (no finalizer, no kopf annotations).
- apiGroups: ["omnimodel.io"]
  resources: ["omnimodels"]
  verbs: ["list", "watch"]
# Status (conditions, per-stage replicas, endpoint) is written only through the status subresource.
- apiGroups: ["omnimodel.io"]
  resources: ["omnimodels/status"]
  verbs: ["patch"]
# Children of each OmniModel: server-side apply (a PATCH, which needs create when the object is new),
# list and watch (the watch-fed cache reconciles read from), get (to tell a name already taken by
# someone else before applying), delete those the spec no longer asks for.
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["create", "patch", "get", "list", "watch", "delete"]
# Stage and gateway Deployments, as above.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["create", "patch", "get", "list", "watch", "delete"]
# The operator's autoscaler sets the replicas of autoscaled stages (provider operator) through the
# scale subresource, as an HPA would.
- apiGroups: ["apps"]
  resources: ["deployments/scale"]
  verbs: ["patch"]
# Per-stage HorizontalPodAutoscalers (stages with autoscaling provider hpa), as above.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["create", "patch", "get", "list", "watch", "delete"]
# Per-stage PodDisruptionBudgets, as above.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch", "get", "list", "watch", "delete"]
# Per-stage NetworkPolicies (operator.networkPolicy), as above; watched even when disabled, to prune.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch", "get", "list", "watch", "delete"]
# The fetch Job of an hf:// model with model.cache (one per revision), as above.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "patch", "get", "list", "watch", "delete"]
# The weights claim the operator creates from model.cache.storageClassName, as above.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["create", "patch", "get", "list", "watch", "delete"]
# Pods, read-only through a watch: explain a stage that is not ready (Unschedulable, ImagePullBackOff).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Secrets an OmniModel names (gateway.apiKeySecret, model.tokenSecret): read one by name to report a
# missing Secret or key (Ready=False/SecretNotFound) before its pods fail on it. Never listed or watched.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# Events on OmniModels: the operator's Ready transitions and kopf's handler warnings.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
Cluster-scoped reads kopf needs in every mode.
*/}}
{{- define "omnimodel-operator.rbac.clusterRules" -}}
# kopf's resource observer: lists and watches CRDs to notice the OmniModel CRD being (re)installed.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}

{{/*
Cluster-scoped reads kopf needs only when it watches a list of namespaces.
*/}}
{{- define "omnimodel-operator.rbac.namespaceObserverRules" -}}
# kopf's namespace observer: lists and watches namespaces to match watchNamespaces (without it kopf
# logs a warning and never notices a watched namespace being recreated).
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}

{{/*
Name of the cluster-scoped RBAC objects: prefixed with the release namespace, so that two releases of
the same name in different namespaces do not fight over one ClusterRole.
*/}}
{{- define "omnimodel-operator.clusterRoleName" -}}
{{- printf "%s-%s" .Release.Namespace (include "omnimodel-operator.fullname" .) }}
{{- end }}

{{/*
kopf peering (peering.enabled): read every peering object of the kind (kopf lists and watches them all)
and patch this release's own, whose status carries the live operator pods. `kind` is ClusterKopfPeering's
plural in cluster-wide mode, KopfPeering's in each watched namespace.
*/}}
{{- define "omnimodel-operator.rbac.peeringRules" -}}
{{- $name := include "omnimodel-operator.peeringName" .root -}}
# kopf's peering watcher: notices other operator pods of this release announcing themselves.
- apiGroups: ["kopf.dev"]
  resources: [{{ .plural | quote }}]
  verbs: ["list", "watch"]
# kopf's keep-alive: this pod's entry in the release's own peering object, removed on exit.
- apiGroups: ["kopf.dev"]
  resources: [{{ .plural | quote }}]
  resourceNames: [{{ $name | quote }}]
  verbs: ["patch"]
{{- end }}
