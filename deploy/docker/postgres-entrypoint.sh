#!/bin/sh
# First start on an empty data volume: a cluster whose superuser is POSTGRES_USER (password
# POSTGRES_PASSWORD, asked of every TCP client) and the database POSTGRES_DB; then the server, on all
# addresses. The official image's entrypoint does the same.
set -e
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    printf '%s\n' "$POSTGRES_PASSWORD" > /tmp/pwfile
    initdb -U "$POSTGRES_USER" --pwfile=/tmp/pwfile --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm /tmp/pwfile
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    pg_ctl -w -o "-c listen_addresses=''" start >/dev/null
    if [ "$POSTGRES_DB" != postgres ]; then createdb -U "$POSTGRES_USER" "$POSTGRES_DB"; fi
    pg_ctl -w stop >/dev/null
fi
exec postgres -c listen_addresses='*'
