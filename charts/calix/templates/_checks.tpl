{{- /*
Relations between values that values.schema.json cannot express. Each refusal names the values.
Included by configmap.yaml, so every render runs it.
*/ -}}
{{- define "calix.checks" -}}
{{- $v := .Values -}}
{{- if gt (int $v.nat.portMin) (int $v.nat.portMax) -}}
{{- fail (printf "nat.portMin %d is above nat.portMax %d" (int $v.nat.portMin) (int $v.nat.portMax)) -}}
{{- end -}}
{{- $names := dict -}}
{{- range $v.pools -}}
{{- if hasKey $names .name -}}
{{- fail (printf "pools: the name %q is used twice (each pool is an IPPool object of that name)" .name) -}}
{{- end -}}
{{- $_ := set $names .name true -}}
{{- if and .namespaceSelector (ne $v.datastore.type "kubernetes") -}}
{{- fail (printf "pools: %s has a namespaceSelector, which needs datastore.type kubernetes (the agents read pods' namespaces from the API)" .name) -}}
{{- end -}}
{{- $prefix := (split "/" .cidr)._1 | atoi -}}
{{- if and .blockSize (lt (int .blockSize) $prefix) -}}
{{- fail (printf "pools: %s has blockSize %d, shorter than its own prefix /%d" .cidr (int .blockSize) $prefix) -}}
{{- end -}}
{{- end -}}
{{- end -}}
