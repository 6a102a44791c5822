"""cluster/: the Ray cluster launcher YAML passes Ray's own validation of `ray up`, the KubeRay RayCluster manifest
the fields KubeRay's CRD requires (cluster/kuberay-crd-facts.json, trimmed from the CRD by
tools/kuberay_crd_facts.py), and the serve command in each is one `dspark-ray serve` accepts."""
from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from dspark_ray import cli
from dspark_ray.spec import SAFE_ENV

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"


def load(name: str):
    with open(CLUSTER / name) as f:
        return json.load(f) if name.endswith(".json") else yaml.safe_load(f)


def serve_args(command: str, env: dict[str, str] | None = None) -> list[str]:
    """The arguments of the `dspark-ray serve` in a shell command line (up to the next shell operator), $VARs
    replaced from `env`."""
    words = shlex.split(re.sub(r"\$(\w+)", lambda m: (env or {}).get(m.group(1), m.group(0)), command))
    at = next(i for i, w in enumerate(words) if w.endswith("dspark-ray") and words[i + 1] == "serve")
    args = []
    for w in words[at + 2:]:
        if w in (")", "&&", ";", "|", "&") or w.startswith((")", ">")):
            break
        args.append(w.rstrip(")"))
    return args


def parsed_serve(monkeypatch, args: list[str]):
    """What `dspark-ray serve ARGS` would run with (argparse's own refusal exits 2)."""
    seen = []
    monkeypatch.setattr(cli, "cmd_serve", lambda a: seen.append(a) or 0)
    assert cli.main(["serve", *args]) == 0
    return seen[0]


# ---- the Ray cluster launcher ------------------------------------------------------------------------------------
def test_the_launcher_yaml_passes_rays_own_validation_and_a_broken_one_does_not():
    from ray.autoscaler._private.util import prepare_config, validate_config
    cfg = load("ray-cluster.yaml")
    prepared = prepare_config(copy.deepcopy(cfg))      # what `ray up` does before it reaches any host
    validate_config(prepared)
    assert prepared["provider"]["type"] == "local"
    assert prepared["available_node_types"]["local.cluster.node"]["min_workers"] == len(cfg["provider"]["worker_ips"])
    broken = copy.deepcopy(cfg)
    broken["head_start_ray_command"] = broken.pop("head_start_ray_commands")         # a typo Ray must refuse
    with pytest.raises(jsonschema.ValidationError, match="head_start_ray_command"):
        validate_config(prepare_config(broken))


def test_the_launcher_starts_ray_with_the_cards_then_serves_from_the_head(monkeypatch):
    cfg = load("ray-cluster.yaml")
    head, workers = cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]
    start = next(i for i, c in enumerate(head) if "ray start --head" in c)
    serve = next(i for i, c in enumerate(head) if "dspark-ray serve" in c)
    assert start < serve == len(head) - 1                           # serve is the head's last step
    (join,) = [c for c in workers if "ray start" in c]
    assert "--address=$RAY_HEAD_IP:6379" in join
    for c in (head[start], join):
        assert "--num-gpus=$(nvidia-smi -L | wc -l)" in c and ". ~/dspark-ray/cluster/dspark.env" in c
    assert any("source scripts/env.sh" in c for c in cfg["setup_commands"])
    a = parsed_serve(monkeypatch, serve_args(head[serve]))
    assert a.detach and a.pending and a.host == "0.0.0.0" and a.address == "127.0.0.1:6379" and a.pairs >= 1


# ---- KubeRay -----------------------------------------------------------------------------------------------------
def test_the_crd_facts_name_their_source():
    facts = load("kuberay-crd-facts.json")
    assert re.fullmatch(r"ray-project/kuberay@[0-9a-f]{40}:ray-operator/config/crd/bases/ray\.io_rayclusters\.yaml",
                        facts["source"]["crd"])
    assert facts["schema"]["properties"]["spec"]["required"] == ["headGroupSpec"]


def test_the_kuberay_manifest_has_what_the_crd_requires_and_a_broken_one_does_not():
    facts, m = load("kuberay-crd-facts.json"), load("kuberay-raycluster.yaml")
    assert (m["apiVersion"], m["kind"]) == (facts["apiVersion"], facts["kind"])
    jsonschema.validate(m, facts["schema"])
    for path, why in ((("spec", "workerGroupSpecs", 0, "groupName"), "'groupName' is a required property"),
                      (("spec", "headGroupSpec", "template"), "'template' is a required property")):
        broken = copy.deepcopy(m)
        *parent, leaf = path
        obj = broken
        for k in parent:
            obj = obj[k]
        del obj[leaf]
        with pytest.raises(jsonschema.ValidationError, match=why):
            jsonschema.validate(broken, facts["schema"])
    broken = copy.deepcopy(m)
    broken["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 2           # must be a string
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        jsonschema.validate(broken, facts["schema"])
    broken["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = "2"
    broken["spec"]["workerGroupSpecs"][0]["replica"] = 4                               # a field KubeRay lacks
    with pytest.raises(jsonschema.ValidationError, match="'replica' was unexpected"):
        jsonschema.validate(broken, facts["schema"])


def test_the_kuberay_manifest_puts_one_nvlink_pair_in_a_pod_and_serves_from_the_head(monkeypatch):
    m = load("kuberay-raycluster.yaml")
    (group,) = m["spec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    assert group["rayStartParams"]["num-gpus"] == "2"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"] == 2
    # the step ring lives in /dev/shm, a pod's 64 MiB unless mounted
    (dshm,) = [v for v in worker["volumeMounts"] if v["mountPath"] == "/dev/shm"]
    assert {v["name"]: v for v in group["template"]["spec"]["volumes"]}[dshm["name"]]["emptyDir"]["medium"] == "Memory"
    (head,) = m["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    for c in (head, worker):
        env = {e["name"]: e["value"] for e in c["env"]}
        assert {k: env.get(k) for k in SAFE_ENV} == SAFE_ENV and c["image"] == worker["image"]
    command = head["lifecycle"]["postStart"]["exec"]["command"][-1]
    assert command.index("ray health-check") < command.index("dspark-ray serve")   # once the GCS answers
    env = {e["name"]: e["value"] for e in head["env"]}
    a = parsed_serve(monkeypatch, serve_args(command, env))
    assert a.detach and a.pending and a.host == "0.0.0.0" and a.pairs == group["replicas"]


# ---- Ray's token authentication and the deployment's token (issue 63) ---------------------------------------------
def test_every_cluster_file_runs_ray_with_token_authentication_and_serves_with_a_token(monkeypatch):
    """The environment files turn Ray's token authentication on; the launcher copies Ray's token to every host; the
    KubeRay manifest asks the operator for it; each serve beyond loopback names its token file, made if missing."""
    for env_file in ("dspark.env", "dspark.systemd.env"):
        assert re.search(r"^(export )?RAY_AUTH_MODE=token$", (CLUSTER / env_file).read_text(), re.M), env_file
    cfg = load("ray-cluster.yaml")
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    serve = cfg["head_start_ray_commands"][-1]
    assert "dspark-ray token --new ~/.dspark-ray/step-token" in serve
    assert parsed_serve(monkeypatch, serve_args(serve)).token_file == "~/.dspark-ray/step-token"
    m = load("kuberay-raycluster.yaml")
    assert m["spec"]["authOptions"] == {"mode": "token"}
    (head,) = m["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    command = head["lifecycle"]["postStart"]["exec"]["command"][-1]
    env = {e["name"]: e["value"] for e in head["env"]}
    assert command.index("dspark-ray token --new") < command.index("dspark-ray serve")
    assert parsed_serve(monkeypatch, serve_args(command, env)).token_file == "~/.dspark-ray/step-token"
    head_sh, worker_sh = (CLUSTER / "start-head.sh").read_text(), (CLUSTER / "start-worker.sh").read_text()
    assert "ray get-auth-token --generate" in head_sh and 'dspark-ray token --new "$token"' in head_sh
    assert 'dspark-ray serve --detach --token-file "$token"' in head_sh and "~/.ray/auth_token" in worker_sh


# ---- stopping (issue 64) --------------------------------------------------------------------------------------------
def test_the_systemd_unit_stops_serve_before_ray(monkeypatch):
    """`systemctl stop` signals serve alone (KillMode=mixed), so its teardown runs while the unit's Ray head is up;
    `ray stop` comes after it, and systemd waits past serve's own bound before it kills what is left."""
    unit = dict(re.findall(r"^(\w+)=(.*)$", (CLUSTER / "dspark-ray.service").read_text(), re.M))
    assert unit["KillMode"] == "mixed" and unit["ExecStopPost"].endswith("ray stop")
    a = parsed_serve(monkeypatch, serve_args(unit["ExecStart"]))
    assert float(unit["TimeoutStopSec"]) > a.stop_timeout, (unit["TimeoutStopSec"], a.stop_timeout)
