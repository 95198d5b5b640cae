"""python -m deploy {render,validate,apply} --overlay cpu|gpu|gpu-keda"""
from __future__ import annotations

import argparse
import sys

from deploy import DEPLOYMENTS, NAMESPACE, OVERLAYS, STATEFULSETS, DeployError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy",
        description="Render, validate and apply the Kubernetes manifests of the specdec stack.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    render = sub.add_parser("render", help="print the rendered manifests of an overlay (no cluster needed)")
    render.add_argument("--overlay", choices=OVERLAYS, required=True, help="deploy/overlays/<name>")
    render.add_argument("-o", "--output", help="write to this file instead of stdout")

    validate = sub.add_parser("validate", help="check an overlay against the OpenAPI schemas and typed models")
    validate.add_argument("--overlay", choices=(*OVERLAYS, "all"), default="all",
                          help="deploy/overlays/<name>, or all of them (default)")
    validate.add_argument("--kubernetes-version", default=None, help="schema version (default: deploy.validate)")

    apply = sub.add_parser("apply", help="apply an overlay and wait for the rollouts")
    apply.add_argument("--overlay", choices=OVERLAYS, required=True, help="deploy/overlays/<name>")
    apply.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    apply.add_argument("--context", help="kubeconfig context")
    apply.add_argument("--namespace", default=NAMESPACE, help=argparse.SUPPRESS)
    apply.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the rollouts (default 900)")
    apply.add_argument("--dry-run", action="store_true", help="server-side dry run; nothing is changed")
    apply.add_argument("--no-wait", action="store_true", help="do not wait for the rollouts")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def cmd_render(args: argparse.Namespace) -> int:
    from deploy.render import render

    text = render(args.overlay)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from deploy import validate
    from deploy.render import render_objects

    version = args.kubernetes_version or validate.KUBERNETES_VERSION
    overlays = OVERLAYS if args.overlay == "all" else (args.overlay,)
    failed = False
    for overlay in overlays:
        objs = render_objects(overlay)
        problems = validate.check_objects(objs, version)
        print(f"{overlay}: {len(objs)} objects, {len(problems)} problems (Kubernetes {version})")
        for p in problems:
            print(f"  {p}")
        failed |= bool(problems)
    return 1 if failed else 0


def cmd_apply(args: argparse.Namespace) -> int:
    from deploy import cluster
    from deploy.render import render_objects

    objs = render_objects(args.overlay)
    api = cluster.load_api_client(args.kubeconfig, args.context)
    external = cluster.referenced_secrets(objs)
    missing = cluster.missing_secrets(api, args.namespace, external) if not args.dry_run else []
    if missing:
        print(f"missing Secrets in namespace {args.namespace}: {', '.join(missing)}", file=sys.stderr)
        print("create them first (README.md, 'Deploy on Kubernetes')", file=sys.stderr)
        return 2
    cluster.apply_objects(api, objs, dry_run=args.dry_run)
    if args.dry_run or args.no_wait:
        return 0
    cluster.wait_for_rollouts(api, args.namespace, DEPLOYMENTS, STATEFULSETS, timeout_s=args.timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commands = {"render": cmd_render, "validate": cmd_validate, "apply": cmd_apply}
    try:
        return commands[args.command](args)
    except DeployError as e:  # one line for the operator, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
