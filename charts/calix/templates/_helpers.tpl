{{/* The release's objects are named after it: <release>, or <release>-calix when the release
name does not say calix. */}}
{{- define "calix.fullname" -}}
{{- if contains "calix" .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-calix" .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "calix.labels" -}}
app.kubernetes.io/name: calix
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "calix.selectorLabels" -}}
app.kubernetes.io/name: calix
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "calix.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "calix.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "calix.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* A host directory as the node sees it: with hostPathsPerNode, the node's own
subdirectory (kubelet expands $(NODE_NAME) in args, not in hostPath: only for args). */}}
{{- define "calix.nodePath" -}}
{{- if .root.Values.hostPathsPerNode -}}
{{- printf "%s/$(NODE_NAME)" (trimSuffix "/" .dir) -}}
{{- else -}}
{{- trimSuffix "/" .dir -}}
{{- end -}}
{{- end -}}

{{/* The subPathExpr of a mount of a per-node host directory. */}}
{{- define "calix.perNodeSubPath" -}}
{{- if .Values.hostPathsPerNode }}
subPathExpr: $(NODE_NAME)
{{- end -}}
{{- end -}}

{{/*
Whether agents take calix off their node when the DaemonSet is deleted: cleanupOnUninstall, with
the kubernetes datastore (the agent follows its DaemonSet through the API).
*/}}
{{- define "calix.cleanupOnUninstall" -}}
{{- if and .Values.cleanupOnUninstall (eq .Values.datastore.type "kubernetes") }}true{{ end }}
{{- end }}

{{/*
Whether the agents get their route-distribution certificates through the Kubernetes API (and
the chart runs calix-signer): routes over TLS with routes.tls.source kubernetes.
*/}}
{{- define "calix.routesCertificates" -}}
{{- if and .Values.routes.enabled (not .Values.routes.plaintext) (eq .Values.routes.tls.source "kubernetes") }}true{{ end }}
{{- end }}

{{/* The CA's Secret and the trust bundle's ConfigMap (one name, two kinds). */}}
{{- define "calix.routesCa" -}}
{{- printf "%s-routes-ca" (include "calix.fullname" .) -}}
{{- end -}}

{{/* calix-signer's name (Deployment, ServiceAccount, roles). */}}
{{- define "calix.signerName" -}}
{{- printf "%s-signer" (include "calix.fullname" .) -}}
{{- end -}}

{{/* A file of files/rbac/ with the names of this release in place of its placeholders. */}}
{{- define "calix.rbacRules" -}}
{{- .root.Files.Get (printf "files/rbac/%s" .file) | replace "CALIX_CA_SECRET" (include "calix.routesCa" .root) | replace "CALIX_CA_CONFIG_MAP" (include "calix.routesCa" .root) -}}
{{- end -}}

{{/* Whether the agents read their certificates from files on the node (routes.tls.source hostPath). */}}
{{- define "calix.routesHostPath" -}}
{{- if and .Values.routes.enabled (not .Values.routes.plaintext) (eq .Values.routes.tls.source "hostPath") }}true{{ end }}
{{- end }}

{{- /*
Whether the agents replace kube-proxy: kubeProxyReplacement.enabled (the default), with the eBPF
dataplane and the kubernetes datastore. Kernel mode, or the etcd datastore, keeps kube-proxy
(NOTES.txt says so). "true" or empty.
*/ -}}
{{- define "calix.replacesKubeProxy" -}}
{{- $v := .Values -}}
{{- if and $v.kubeProxyReplacement.enabled (eq $v.dataplane "ebpf") (eq $v.datastore.type "kubernetes") }}true{{ end }}
{{- end }}

{{- /*
The API server reached directly (kubeProxyReplacement.apiServer): without kube-proxy the
kubernetes Service's cluster IP answers only once the agents translate it. Empty without a host.
*/ -}}
{{- define "calix.apiServerEnv" -}}
{{- with .Values.kubeProxyReplacement.apiServer }}
{{- if .host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ .host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .port | quote }}
{{- end }}
{{- end }}
{{- end -}}
