#!/bin/sh
# pip inside the image build, with what the build arguments name in /tmp/local (the Dockerfile's LOCAL_DIR):
# CA_BUNDLE, a CA bundle pip trusts, and WHEELS, a folder of wheels pip looks in first.
set -e
if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="/tmp/local/$CA_BUNDLE"; fi
if [ -n "$WHEELS" ]; then export PIP_FIND_LINKS="/tmp/local/$WHEELS"; fi
exec pip "$@"
