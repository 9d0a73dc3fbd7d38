"""Print the Kubernetes objects of one model version as a YAML stream, for review or
``kubectl apply --dry-run=server -f -`` on a cluster:

    python -m tasks.kube MANIFEST.yaml --image modelops-runtime:26.07-vllm0.24.0-<sha12> [--replicas N]

Objects: the FSx PersistentVolume and claim (only with MODELOPS_K8S_FSX_FILESYSTEM_ID), the
version's Service and Deployment (resources from the manifest, package at
``<MODELOPS_HOME>/packages/<model>/<version>``) and the model's HTTPRoute sending it all traffic
(with ``k8s_kserve_routes``, also its KServe HTTPRoute and GRPCRoute).
Settings come from the environment (``MODELOPS_K8S_*``); nothing contacts a cluster.

    python -m tasks.kube batch-api --image REGISTRY/modelops-control-plane:TAG

prints the batch API's NetworkPolicy, Service and Deployment instead (tasks/kube/batch_api.py);
its HTTPRoute and SecurityPolicy come from the router while that Service exists.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from modelops.errors import ModelopsError
from modelops.manifest import load_manifest
from modelops.settings import get_settings, settings_problem
from tasks.kube.batch_api import render_batch_api
from tasks.kube.manifests import (
    ServingSpec,
    image_reference,
    object_name,
    render_deployment,
    render_fsx_storage,
    render_httproute,
    render_inferencepool,
    render_service,
)


class _NoAliases(yaml.SafeDumper):
    """Shared sub-dicts written out in full: a reviewer reads each object on its own."""

    def ignore_aliases(self, data) -> bool:
        return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    batch_api = argv[:1] == ["batch-api"]
    p = argparse.ArgumentParser(
        prog="python -m tasks.kube" + (" batch-api" if batch_api else ""),
        description="Print the batch API's NetworkPolicy, Service and Deployment as a YAML stream (docs/kubernetes.md, "
        "'The batch API')" if batch_api else "Print the Kubernetes objects of one model version as a YAML stream, "
        "for review or `kubectl apply --dry-run=server -f -`; settings come from MODELOPS_K8S_* (docs/kubernetes.md)")
    if batch_api:
        p.add_argument("--image", required=True, help="the control-plane image: REGISTRY/REPOSITORY:TAG")
    else:
        p.add_argument("manifest", help="the model's announcement (YAML); or `batch-api` for the batch API's objects")
        p.add_argument("--image", required=True, help="runtime image tag from `modelops image plan`, or a full "
                       "reference")
        p.add_argument("--replicas", type=int, default=1)
    args = p.parse_args(argv[1:] if batch_api else argv)
    try:
        settings = get_settings()
    except Exception as e:  # noqa: BLE001 - settings_problem tells a settings error from the rest
        if (problem := settings_problem(e)) is None:
            raise
        print(f"error: invalid setting: {problem}", file=sys.stderr)
        return 2
    if batch_api:
        try:
            objects = render_batch_api(args.image, settings)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        yaml.dump_all(objects, sys.stdout, Dumper=_NoAliases, sort_keys=False)
        return 0
    try:
        m = load_manifest(args.manifest)
        spec = ServingSpec(m.model_id, m.version, image_reference(args.image, settings),
                           str(settings.packages_dir / m.model_id / m.version), m.resources.cpus,
                           m.resources.memory_gb, m.resources.gpus, args.replicas)
        objects = [*(render_fsx_storage(settings) if settings.k8s_fsx_filesystem_id else []),
                   render_service(m.model_id, m.version, settings), render_deployment(spec, settings),
                   *([render_inferencepool(m.model_id, m.version, settings)] if settings.k8s_inference_pool else []),
                   *(render_httproute(m.model_id, {m.version: (object_name(m.model_id, m.version), 100)}, settings, p)
                     for p in (("openai", "kserve-http", "kserve-grpc") if settings.k8s_kserve_routes else ("openai",)))]
    except (ModelopsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    yaml.dump_all(objects, sys.stdout, Dumper=_NoAliases, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
