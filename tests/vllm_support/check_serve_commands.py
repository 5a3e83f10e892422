"""Check server commands as far as vLLM's CPU build can without starting them: run with ``.venv-vllm``'s python.

Reads a JSON list of commands (each a list of arguments: ``vllm serve MODEL ...`` or ``python -m
vllm.entrypoints.openai.api_server ...``) on standard input. For each, vLLM's own ``serve`` parser
takes the arguments (an unknown or renamed flag fails here as it would in ``vllm serve``), vLLM
builds its engine arguments and ``KVTransferConfig`` from them, and kvstore reads its options the way
the connector or tier will at start (a wrong option name or value fails here with kvstore's error).
Prints one line per command: ``ok <connector>`` or ``error <message>``.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

API_SERVER = ["python", "-m", "vllm.entrypoints.openai.api_server"]


def serve_arguments(command: list[str]) -> list[str]:
    """The arguments after ``vllm serve``: a model given by ``--model`` in the api_server form."""
    if command[:2] == ["vllm", "serve"]:
        return command[2:]
    if command[1:3] == API_SERVER[1:]:
        return command[3:]
    raise ValueError(f"not a vLLM server command: {command[:3]}")


def check_kvstore_options(transfer: Any) -> str:
    """Read kvstore's options from a ``KVTransferConfig`` as the connector or the tier will; the connector's name."""
    from kvstore.connectors.vllm._common import read_options
    from kvstore.connectors.vllm.tier import TIER_OPTIONS

    extra = transfer.kv_connector_extra_config or {}
    if transfer.kv_connector == "KVStoreConnector":
        module = importlib.import_module(transfer.kv_connector_module_path)
        # What vLLM asks while it builds its configuration (a GPU build): it reads kvstore's options.
        module.KVStoreConnector.requires_piecewise_for_cudagraph(extra)
        return "KVStoreConnector"
    if transfer.kv_connector == "OffloadingConnector":
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        OffloadingSpecFactory.get_spec_cls(extra)  # the spec vLLM will build
        tiers = [tier for tier in extra.get("secondary_tiers", []) if tier.get("type") == "KVStoreTier"]
        if not tiers:
            raise ValueError("an OffloadingConnector without a KVStoreTier in secondary_tiers")
        for tier in tiers:
            importlib.import_module(tier["module_path"]).KVStoreTier  # noqa: B018 (the class the tier names)
            # vLLM takes these out before it builds the tier; the rest are kvstore's.
            options = {k: v for k, v in tier.items() if k not in ("type", "module_path", "backpressure", "locality")}
            read_options(options, lambda: "checked-only", TIER_OPTIONS, ())
        return "OffloadingConnector with KVStoreTier"
    raise ValueError(f"no kvstore connector in the command: {transfer.kv_connector!r}")


def check(command: list[str]) -> str:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    serve.exit_on_error = False
    args = parser.parse_args(["serve", *serve_arguments(command)])
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    engine = AsyncEngineArgs.from_cli_args(args)
    if engine.kv_transfer_config is None:
        raise ValueError("no --kv-transfer-config")
    return check_kvstore_options(engine.kv_transfer_config)


def main() -> None:
    for command in json.load(sys.stdin):
        try:
            print(f"ok {check(command)}", flush=True)
        except (Exception, SystemExit) as error:  # one line per command, whatever failed
            print(f"error {type(error).__name__}: {error}".replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
