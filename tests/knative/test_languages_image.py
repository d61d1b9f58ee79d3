"""The image with the language snapshots baked in (scripts/image-languages), run as the pod tests run the
image (tests/knative/podkit.py: the manifest's container spec under rootful podman, a real SeaweedFS as
its S3 store), with building off: a language runs from the first request only if the image holds it.

Lean on purpose: the variant is made from the base image the pod tests build (scripts/image) with one
language, bash (the shared Debian base alone), from the language test store; the image's build of every
language is the same script with no --languages (its size: README, docs/languages.md).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import httpx
import pytest

from tests import langhome
from tests.knative import podkit
from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
LANG_HOME = langhome.LANG_HOME


@pytest.fixture(scope="module")
def tag() -> str:
    podkit.base_image()  # built and loaded when its sources changed
    base = podkit.REPO / "dist" / f"rollbox-{podkit.version()}.oci.tar"
    archive = podkit.REPO / "dist" / f"rollbox-{podkit.version()}-languages-test.oci.tar"
    script = podkit.REPO / "scripts" / "image-languages"
    if not archive.exists() or archive.stat().st_mtime < max(base.stat().st_mtime, script.stat().st_mtime):
        with langhome.building():  # (the store's Debian layers serve)
            done = subprocess.run([str(script), "--languages", "bash", "--home", str(LANG_HOME), "--from",
                                   str(base), "--out", str(archive)], capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-4000:]
    tag = f"localhost/rollbox:{podkit.version()}-languages"
    subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)
    subprocess.run(["podman", "load", "-q", "-i", str(archive)], check=True, capture_output=True, timeout=600)
    return tag


@pytest.fixture
def pod(tag: str, seaweed: SeaweedS3) -> Iterator[podkit.Pod]:
    s3 = podkit.s3_env(seaweed.endpoint, seaweed.new_bucket(), ACCESS_KEY, SECRET_KEY)
    p = podkit.Pod(tag, env={**s3, "ROLLBOX_LANGUAGE_BUILDS": "off"})
    yield p
    p.remove()


def test_the_languages_image_runs_a_baked_language_from_its_first_request(tag: str, pod: podkit.Pod) -> None:
    label = subprocess.run(["podman", "image", "inspect", "--format", '{{index .Labels "dev.rollbox.languages"}}', tag],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert label == "bash"
    pod.start().wait_ready()
    states = {r["language"]: r for r in httpx.get(pod.url + "languages", timeout=30).json()}
    assert states["bash"]["state"] == "ready" and states["bash"]["built_on_first_use"] is False
    assert states["lua"]["state"] == "missing"  # only what the image was made with
    r = httpx.post(pod.url + "run_code", json={"code": "read a b; echo $((a * b))", "language": "bash",
                                               "stdin": "6 7"}, timeout=120)
    assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text
    r = httpx.post(pod.url + "run_code", json={"code": "print(1)", "language": "lua"}, timeout=60)
    assert r.status_code == 503 and "lua" in r.json()["detail"], r.text  # not baked, and building is off
