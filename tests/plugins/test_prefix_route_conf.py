"""The shipped routing examples (conf/route-*.yaml, conf/kubernetes/) are valid configs."""
from __future__ import annotations

import pytest
import yaml

from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import load, validate
from tests.helpers import CONF


def buildable(cfg: dict) -> dict:
    """Without prerender (it would load the example's tokenizer from /models)."""
    cfg = dict(cfg)
    cfg["plugins"] = [p for p in cfg["plugins"] if not (isinstance(p, dict) and "prerender" in p)]
    return cfg


@pytest.mark.parametrize("name", ["route-chwbl.yaml", "route-cache-aware.yaml",
                                  "route-predicted-ttft.yaml"])
def test_route_examples_validate_and_build(name):
    cfg = load(CONF / name)
    gw = Gateway(buildable(cfg))
    route = next(p for p in gw.chain.plugins if p.name == "prefix_route")
    assert route.policy in name.replace("-", "_")


def test_kubernetes_example_is_a_multi_replica_gateway_with_discovery():
    docs = {}
    for f in sorted((CONF / "kubernetes").glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            docs[(d["kind"], d["metadata"]["name"])] = d
    deployment = docs[("Deployment", "prefixgate")]
    assert deployment["spec"]["replicas"] > 1
    assert docs[("Service", "vllm-headless")]["spec"]["clusterIP"] == "None"
    cfg = validate(yaml.safe_load(docs[("ConfigMap", "prefixgate")]["data"]["gateway.yaml"]))
    assert cfg["discovery"]["dns"].startswith("vllm-headless.")
    assert cfg["discovery"]["port"] == 8000
    Gateway(cfg)
    mount = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert mount[-1] == "/etc/prefixgate/gateway.yaml"


def test_production_example_validates_and_builds_every_plugin():
    cfg = load(CONF / "gateway.production.yaml")
    gw = Gateway(cfg)
    assert [p.name for p in gw.chain.plugins] == ["admission", "normalize", "prefix_route",
                                                  "metrics"]
    assert cfg["auth"]["api_keys"] and cfg["admin_listen"]["port"] == 9090
