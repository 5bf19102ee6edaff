#!/usr/bin/env bash
# Builds a Go module offline from Debian's Go sources (/usr/share/gocode/src, the
# golang-*-dev packages), with no module proxy: writes OUT, a copy of MODULE_DIR/go.mod
# that takes every dependency from there, for `go build -modfile=OUT`.
#
#   client/go/gomod-debian.sh MODULE_DIR OUT
#   cd MODULE_DIR && GOFLAGS=-mod=readonly GOPROXY=off go build -modfile=OUT ./...
#
# A module Debian ships with its go.mod is replaced by its directory; one that only appears
# in the module graph (a dependency's requirement whose packages the build never imports, e.g.
# grpc's envoyproxy/go-control-plane) by an empty module under OUT's folder. Go reads no
# go.sum for directory replacements, so none is needed. MODULE_DIR/go.mod is not changed, and
# a missing requirement there is still an error.
set -euo pipefail
module_dir=$(cd "$1" && pwd)
out=$(realpath -m "$2")
gocode=${GOCODE:-/usr/share/gocode/src}
stubs=$(dirname "$out")/stubs
mkdir -p "$(dirname "$out")"
cp "$module_dir/go.mod" "$out"
rm -f "${out%.mod}.sum"
replaced=" "

replace() { # MODULE: one replace directive, to Debian's copy or to an empty module
    local module=$1 dir
    if [[ -f $gocode/$module/go.mod ]]; then
        dir=$gocode/$module
    else
        dir=$stubs/$module
        mkdir -p "$dir"
        echo "module $module" >"$dir/go.mod"
    fi
    printf 'replace %s => %s\n' "$module" "$dir" >>"$out"
    replaced+="$module "
}

# The requirements of go.mod first, then whatever the module graph asks for, one round a
# module (each round a failed lookup names the next).
for module in $(sed -n 's/^[[:space:]]*\([a-z][^[:space:]]*\.[^[:space:]]*\) v[0-9][^[:space:]]*.*$/\1/p' "$out"); do
    [[ $replaced == *" $module "* ]] || replace "$module"
done
for _ in $(seq 100); do
    if log=$(cd "$module_dir" && GO111MODULE=on GOFLAGS=-mod=readonly GOPROXY=off GOSUMDB=off \
        go list -modfile="$out" -deps -test ./... 2>&1 >/dev/null); then
        exit 0
    fi
    module=$(grep -o '[^[:space:]]*@[^[:space:]:]*: module lookup disabled' <<<"$log" |
        head -n1 | sed 's/@.*//') || true
    if [[ -z $module || $replaced == *" $module "* ]]; then
        echo "gomod-debian: $module_dir does not build from $gocode:" >&2
        echo "$log" >&2
        exit 1
    fi
    replace "$module"
done
echo "gomod-debian: too many modules" >&2
exit 1
