"""The ``jaxmoe`` command line: ``generate``, ``mesh show``, ``train``, ``eval``, ``profile``, ``plan``,
``simulate``, ``serve``, ``client``, ``lower``.

Each subcommand is a small function taking the parsed arguments; ``main`` only dispatches.
"""

from __future__ import annotations

import argparse
import sys

from jaxmoe.options import EXPERT_IMPLS

DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_dtype(text: str) -> str | None:
    """``--dtype``: checked when the command line is parsed, before anything loads; ``auto`` (None)
    keeps the checkpoint's ``torch_dtype``."""
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)}, got {text!r}")
    return None if text == "auto" else text


def _add_model_args(
    p: argparse.ArgumentParser, mesh: bool = True, dtype: bool = True, quantization: bool = False
) -> None:
    """--model, --mesh, --dtype; with ``quantization``: --quantization and --quantize-attention."""
    p.add_argument(
        "--model",
        default="demo",
        help="checkpoint directory, 'demo' (the built-in trained model) or 'tiny-random' (a test fixture)",
    )
    if mesh:
        p.add_argument("--mesh", default=None, help="mesh file (meshes/*.yaml); default: monolithic on one device")
    if dtype:
        p.add_argument(
            "--dtype",
            type=parse_dtype,
            default=None,
            metavar="{" + ",".join(DTYPES) + "}",
            help="parameter dtype (default auto: the checkpoint's torch_dtype)",
        )
    if quantization:
        p.add_argument(
            "--quantization",
            default=None,
            choices=["int8", "fp8"],
            help="quantize the routed expert weights on load: int8 per output channel, fp8 e4m3 per 128x128 block",
        )
        p.add_argument(
            "--quantize-attention", action="store_true", help="with --quantization: the attention projections too"
        )


def cmd_generate(args) -> int:
    from jaxmoe import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        quantize_attention=args.quantize_attention,
        mesh=args.mesh,
        expert_impl=args.expert_impl,
    )
    chosen = {
        k: v
        for k, v in (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p))
        if v is not None
    }
    # the checkpoint's generation_config.json fills what the command line leaves unset (else greedy)
    sampling = {**llm.generation_config, **chosen}
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop or ()), **sampling)
    prompts = args.prompt or ["Hello"]
    for prompt, out in zip(prompts, llm.generate(prompts, params, priority=args.priority)):
        print(f"--- prompt: {prompt!r}")
        print(out.text)
        print(f"--- {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
    return 0


def cmd_mesh_show(args) -> int:
    from jaxmoe.mesh import load_mesh

    spec = load_mesh(args.file)
    text = spec.describe()
    if spec.brownout is not None:  # validated and described by the brownout package
        from jaxmoe.brownout.config import describe, mesh_brownout

        head, _, _ = text.rpartition("\n  brownout: ")
        text = f"{head}\n  brownout: {describe(mesh_brownout(spec))}"
    print(text)
    return 0


class _Parser(argparse.ArgumentParser):
    """One line per mistake (not the whole usage of a command with fifty options)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxmoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_model_args(gen, quantization=True)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the model's generation_config.json, else greedy)",
    )
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--priority", default="be", choices=["ls", "be"])
    gen.add_argument(
        "--expert-impl",
        default="auto",
        choices=["auto", *EXPERT_IMPLS],
        help="expert-FFN implementation (auto: the fastest on this backend)",
    )
    gen.set_defaults(func=cmd_generate)

    mesh = sub.add_parser("mesh", help="mesh files")
    mesh_sub = mesh.add_subparsers(dest="mesh_command", required=True)
    show = mesh_sub.add_parser("show", help="print the layout a mesh file describes")
    show.add_argument("file")
    show.set_defaults(func=cmd_mesh_show)

    from jaxmoe.findep.commands import register as register_planning_commands  # profile, plan
    from jaxmoe.janus.scaling.commands import register as register_scaling_commands  # simulate
    from jaxmoe.lowering import register as register_lower_command  # lower
    from jaxmoe.train.commands import register as register_train_commands  # train, eval
    from jaxmoe.server.cli import register as register_server_commands  # serve, client

    register_train_commands(sub, _add_model_args)
    register_planning_commands(sub, _add_model_args)
    register_scaling_commands(sub, _add_model_args)
    register_server_commands(sub, _add_model_args)
    register_lower_command(sub, _add_model_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxmoe: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
