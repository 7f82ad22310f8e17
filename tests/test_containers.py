"""The container set-up, checked statically (no Docker engine runs here): the compose file's
services, builds, mounts and dependencies; the Dockerfiles' copied paths and version pins against
pyproject.toml; every command line against kvscope's own CLI parser; the Prometheus and
Alertmanager configs with ``promtool`` / ``amtool`` (Debian's prometheus and
prometheus-alertmanager packages) and the agent's notification file with its strict loader;
Grafana's provisioning (the compose Prometheus, the generated dashboard); ``docker compose
config`` where the compose plugin exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from alerts.notify_config import load_notify_config
from kvscope.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
SERVICES = {"engine", "agent", "dashboard", "prometheus", "alertmanager", "grafana"}


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for dep in project["dependencies"]:
        name, sep, version = dep.partition("==")
        if sep:
            out[name.strip().lower()] = version.strip()
    return out


def test_the_compose_file_wires_the_six_services() -> None:
    doc = compose()
    services = doc["services"]
    assert set(services) == SERVICES
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
        build = svc.get("build")
        if build:
            assert (DOCKER / build["context"] / build["dockerfile"]).is_file(), name
        else:
            assert "image" in svc, name
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).is_file(), f"{name} mounts missing {source}"
            else:
                assert source in doc.get("volumes", {}), f"{name} mounts undeclared volume {source}"
        for port in svc.get("ports", []):
            assert re.fullmatch(r"\d+:\d+", port), port
    gpu = services["engine"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["dashboard"]["image"] == services["agent"]["image"]  # one image, two commands


def test_grafana_is_provisioned_with_the_compose_prometheus_and_the_dashboard() -> None:
    services = compose()["services"]
    grafana = services["grafana"]
    mounts = dict(m.removesuffix(":ro").split(":", 1) for m in grafana["volumes"])  # source → target
    datasources = yaml.safe_load((DOCKER / "grafana" / "datasources.yaml").read_text())["datasources"]
    assert [(d["type"], d["url"], d["isDefault"]) for d in datasources] == [("prometheus", "http://prometheus:9090", True)]
    assert "9090:9090" in services["prometheus"]["ports"] and "prometheus" in grafana["depends_on"]
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert datasources[0]["jsonData"]["timeInterval"] == scrape  # $__rate_interval covers 4 scrapes
    (provider,) = yaml.safe_load((DOCKER / "grafana" / "dashboards.yaml").read_text())["providers"]
    assert provider["type"] == "file"
    dashboard = mounts["../dashboards/grafana/kvscope.json"]
    assert dashboard == provider["options"]["path"] + "/kvscope.json"
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard
    assert mounts["./grafana/datasources.yaml"].startswith("/etc/grafana/provisioning/datasources/")
    assert mounts["./grafana/dashboards.yaml"].startswith("/etc/grafana/provisioning/dashboards/")


def dockerfile_pins(text: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"\b([A-Za-z][\w.-]*)==([\w.+-]+)", text)}


@pytest.mark.parametrize("name", ["engine.Dockerfile", "agent.Dockerfile"])
def test_dockerfiles_copy_what_exists_and_pin_what_pyproject_pins(name: str) -> None:
    text = (DOCKER / name).read_text()
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _dest = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{name} copies missing {source}"
    found = dockerfile_pins(text)
    assert {"torch", "triton"} <= set(found)
    expected = pins()
    for package, version in found.items():
        assert expected.get(package) == version, f"{name} pins {package}=={version}, pyproject.toml {expected.get(package)}"
    assert "pip install ." in text  # everything else comes from pyproject.toml's own pins
    base = re.search(r"^FROM (\S+)", text, re.M)
    assert base is not None and ("nvidia/cuda" in base.group(1)) == (name == "engine.Dockerfile")


def exec_form(dockerfile: str, instruction: str) -> list[str]:
    """The JSON (exec) form of a Dockerfile's ENTRYPOINT or CMD."""
    found = re.search(rf"^{instruction} (.+)$", (DOCKER / dockerfile).read_text(), re.M)
    assert found is not None, f"{dockerfile} has no {instruction}"
    value = json.loads(found.group(1))
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def test_every_command_line_parses_with_the_cli() -> None:
    parser = build_parser()
    services = compose()["services"]
    for dockerfile in ("engine.Dockerfile", "agent.Dockerfile"):
        entry = exec_form(dockerfile, "ENTRYPOINT")
        assert entry[0] == "kvscope"
        parser.parse_args(entry[1:] + exec_form(dockerfile, "CMD"))  # the image's own default
    engine = parser.parse_args(exec_form("engine.Dockerfile", "ENTRYPOINT")[1:] + services["engine"]["command"])
    assert engine.command == "serve" and engine.host == "0.0.0.0" and engine.agent == "http://agent:9400"
    for name in ("agent", "dashboard"):  # the compose command replaces the agent image's CMD
        args = parser.parse_args(services[name]["command"])
        assert args.command == name and args.host == "0.0.0.0"


def test_the_notification_file_loads_and_reaches_alertmanager(tmp_path: Path) -> None:
    config = load_notify_config(DOCKER / "notify.yaml", data_dir=tmp_path)
    assert [a.url for a in config.alertmanagers] == ["http://alertmanager:9093"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_accepts_the_prometheus_config() -> None:
    done = subprocess.run(["promtool", "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("amtool") is None, reason="amtool not installed (Debian package prometheus-alertmanager)")
def test_amtool_accepts_the_alertmanager_config() -> None:
    done = subprocess.run(["amtool", "check-config", str(DOCKER / "alertmanager.yml")], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30, check=False).returncode == 0


@pytest.mark.skipif(not compose_plugin(), reason="the docker compose plugin is not installed (the YAML checks above still run)")
def test_docker_compose_config_accepts_the_file() -> None:
    done = subprocess.run(["docker", "compose", "-f", str(DOCKER / "compose.yaml"), "config", "--quiet"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
