#!/usr/bin/env bash
# Creates the Secrets the manifests mount: CURVE key pairs (from `llmpool keys`) and the API key(s).
#   deploy/kubernetes/make-secrets.sh [-n NAMESPACE]
#   LLMPOOL_API_KEY=key1,key2 ...   use these API keys (default: one random key, printed)
#   LLMPOOL_POSTGRES_PASSWORD=...   the state store's password (default: a random one)
#   DRY_RUN=1 ...                   print the Secrets as YAML instead of applying them
#   LLMPOOL="python -m launcher"    how to run llmpool (default: llmpool on PATH)
# Running it again makes new CURVE keys: restart gateways and workers afterwards (they read keys at start).
set -euo pipefail
ns=()
if [ "${1:-}" = "-n" ]; then ns=(-n "$2"); fi
folder=$(mktemp -d)
trap 'rm -rf "$folder"' EXIT
${LLMPOOL:-llmpool} keys "$folder/curve" --workers 1 >/dev/null
api_key=${LLMPOOL_API_KEY:-$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')}
[ -n "${LLMPOOL_API_KEY:-}" ] || echo "API key: $api_key" >&2

secret() {
    if [ -n "${DRY_RUN:-}" ]; then
        kubectl create secret generic "$@" "${ns[@]}" --dry-run=client -o yaml
        echo ---
    else
        kubectl create secret generic "$@" "${ns[@]}" --dry-run=client -o yaml | kubectl apply "${ns[@]}" -f -
    fi
}
# Gateways: their secret key, and the folder of worker public keys they accept.
secret llmpool-curve-gateway --from-file=gateway.key_secret="$folder/curve/gateway.key_secret"
secret llmpool-curve-authorized --from-file="$folder/curve/authorized"
# Workers (all replicas, all models): one key pair, and the gateways' public key.
secret llmpool-curve-worker --from-file=worker.key_secret="$folder/curve/worker-0.key_secret" --from-file=gateway.key="$folder/curve/gateway.key"
secret llmpool-api-keys --from-literal=api-key="$api_key"
# The state store (base/postgres.yaml): its password, and the URL the gateways use to reach it.
pg_password=${LLMPOOL_POSTGRES_PASSWORD:-$(python3 -c 'import secrets; print(secrets.token_hex(24))')}
secret llmpool-postgres --from-literal=password="$pg_password" --from-literal=url="postgresql://llmpool:$pg_password@llmpool-postgres:5432/llmpool"
