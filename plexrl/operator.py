"""Operators: typed, reusable units of RLVR work.

An operator is a plain function wrapped by `@operator(runs_on=...)`:

    @operator(runs_on="cpu")
    def verify(rollouts: Rollouts, ctx: OpContext, *, correct_reward: float = 1.0) -> Rewards: ...

- positional parameters annotated with a `Batch` subclass are the *inputs* (an `X | None = None` input is
  optional); one parameter annotated `OpContext` receives the run context;
- keyword-only parameters are the *parameters*, validated by a pydantic model built from their hints
  (use `Annotated[float, Field(gt=0)]` for ranges) with `extra="forbid"`;
- the return annotation, a `Batch` subclass, is the *output type*.

`chunk_input="prompts"` declares a service operator *chunkable* (function-level preemption, `JobConfig.chunks`):
the named input's type slices rows (`rows(start, stop)`, and `len`) and the output type concatenates parts
(`concat(parts, pad_id)`), so that the service may run the node as C chunks, chunk k on rows
`batch.chunk_rows(P, k, C)` of that input, and hand downstream nodes the concatenation of the C outputs.

`runs_on` says where a node of the operator runs: `service` (inside the job's LLM service, with the
engine in `ctx.engine`) or `cpu` (the CPU pool; `ctx.engine` is None). ("Placement" is another thing: where
a JOB goes, the planner's placement policy.) Operators never import mlflow and never touch another job's
state.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
import types
import typing
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from plexrl.batch import Batch
from plexrl.errors import Problem

RunsOn = Literal["service", "cpu"]


@dataclass(slots=True)
class OpContext:
    """What a running node may see: its own job's identity, task, tokenizer and (service nodes) engine.

    `engine` is the job's `Engine` on its service; None for cpu nodes. `seed(*keys)` derives a stable
    seed from the job seed, the iteration, the node and any extra keys, so that results do not depend on
    what other jobs run in between (docs invariant 4). A chunked node runs chunk `chunk` of `chunks`
    (then the chunk is part of every seed: each chunk samples with its own stream; chunks == 1 leaves the
    seeds of an unchunked node unchanged).
    """

    job_id: str
    iteration: int
    node: str
    job_seed: int
    task: Any = None
    tokenizer: Any = None
    engine: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    chunk: int = 0
    chunks: int = 1
    # a sliced node's `plexrl.engines.slicing.SliceSlot` (`JobConfig.slices`, decode-step preemption): where its
    # paused generation waits between slices, kept by the service; None: the node runs whole
    slice: Any = None

    def seed(self, *keys: object) -> int:
        if self.chunks > 1:
            keys = (*keys, f"chunk {self.chunk} of {self.chunks}")
        text = "/".join(str(k) for k in (self.job_seed, self.iteration, self.node, *keys))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF


@dataclass(frozen=True, slots=True)
class Port:
    """A named input of an operator: its type and whether it may be left unconnected."""

    name: str
    type: type[Batch]
    optional: bool


def _built_in(module: str) -> bool:
    return module == "plexrl" or module.startswith("plexrl.")


def _operator_at(module: str, attr: str) -> Operator:
    """The operator `attr` of `module` (how an importable operator is unpickled)."""
    op = getattr(importlib.import_module(module), attr)
    if not isinstance(op, Operator):
        raise TypeError(f"{module}:{attr} is not an operator")
    return op


class Operator:
    """A typed operator; call `run(ctx, inputs, params)` to execute it."""

    __plexrl_role__ = "operator"  # its instances are declared operators (`plexrl.roles.is_declared`)

    def __init__(
        self,
        fn: Callable[..., Batch],
        runs_on: RunsOn,
        name: str | None = None,
        *,
        inline: bool = True,
        chunk_input: str | None = None,
        sliceable: bool = False,
        moved: dict[str, str] | None = None,
    ) -> None:
        if runs_on not in ("service", "cpu"):
            raise ValueError(f"runs_on must be 'service' or 'cpu', got {runs_on!r}")
        self.fn = fn
        self.runs_on: RunsOn = runs_on
        # inline=False: never run in the driver process, even when fast (tool calls, untrusted code)
        self.inline = inline
        self.name = name or fn.__name__
        self.ref = f"{fn.__module__}:{fn.__name__}"
        self.doc = inspect.getdoc(fn) or ""
        self.inputs: dict[str, Port] = {}
        self.ctx_arg: str | None = None
        hints = typing.get_type_hints(fn, include_extras=True)
        fields: dict[str, Any] = {}
        for p in inspect.signature(fn).parameters.values():
            hint = hints.get(p.name)
            if p.kind is p.KEYWORD_ONLY:
                if hint is None:
                    raise TypeError(f"operator {self.ref}: parameter {p.name!r} needs a type hint")
                default = ... if p.default is p.empty else p.default
                fields[p.name] = (hint, default)
            elif hint is OpContext:
                self.ctx_arg = p.name
            else:
                port_type, optional = _port_type(hint)
                if port_type is None:
                    raise TypeError(
                        f"operator {self.ref}: input {p.name!r} must be annotated with a Batch subclass "
                        f"(or X | None), got {hint!r}; make parameters keyword-only (after `*`)"
                    )
                self.inputs[p.name] = Port(p.name, port_type, optional or p.default is None)
        out = hints.get("return")
        if not (isinstance(out, type) and issubclass(out, Batch)):
            raise TypeError(f"operator {self.ref}: return annotation must be a Batch subclass, got {out!r}")
        self.output: type[Batch] = out
        self.chunk_input = chunk_input  # the row-sliceable input of a chunkable service operator (`chunkable`)
        if sliceable and runs_on != "service":
            raise TypeError(f"operator {self.ref}: only service operators run in slices (sliceable=True)")
        self.sliceable = sliceable  # its generation may pause between decode steps (`OpContext.slice`)
        # former parameters -> the sentence that says what replaces each (an old config's error names it)
        self.moved: dict[str, str] = dict(moved or {})
        if chunk_input is not None:
            self._check_chunkable(chunk_input)
        self.params_model: type[BaseModel] = create_model(
            f"{self.name}_params", __config__=ConfigDict(extra="forbid"), **fields
        )
        if _built_in(fn.__module__):  # found by pickle as `<module>.<function name>.params_model` (the node's
            # params then pickle by reference, like the operator: `__reduce_ex__`)
            self.params_model.__module__ = fn.__module__
            self.params_model.__qualname__ = f"{fn.__name__}.params_model"

    @property
    def chunkable(self) -> bool:
        """Whether a node of this operator may run as several chunks (`JobConfig.chunks`)."""
        return self.chunk_input is not None

    def _check_chunkable(self, port: str) -> None:
        if self.runs_on != "service":
            raise TypeError(f"operator {self.ref}: only service operators run in chunks (chunk_input={port!r})")
        if port not in self.inputs:
            raise TypeError(f"operator {self.ref}: chunk_input {port!r} is not one of its inputs {list(self.inputs)}")
        if not callable(getattr(self.inputs[port].type, "rows", None)):
            raise TypeError(
                f"operator {self.ref}: chunk_input {port!r} is a {self.inputs[port].type.__name__}, which has no "
                "rows(start, stop) to slice it"
            )
        if not callable(getattr(self.output, "concat", None)):
            raise TypeError(
                f"operator {self.ref}: its output {self.output.__name__} has no concat(parts, pad_id) to join chunks"
            )

    def check_params(self, raw: dict[str, Any], where: str) -> tuple[BaseModel | None, list[Problem]]:
        """Validate raw parameters; return the parsed model or the problems, each naming the field (a former
        parameter, `moved`, with what replaces it)."""
        problems = [Problem(f"{where}.params.{k}", self.moved[k]) for k in raw if k in self.moved]
        try:
            parsed = self.params_model(**{k: v for k, v in raw.items() if k not in self.moved})
            return (None, problems) if problems else (parsed, [])
        except ValidationError as exc:
            for err in exc.errors():
                loc = ".".join(str(x) for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    known = ", ".join(self.params_model.model_fields) or "none"
                    msg = f"unknown parameter of operator {self.name!r}; known parameters: {known}"
                elif err["type"] == "missing":
                    msg = f"required parameter of operator {self.name!r} is missing; set it under params"
                else:
                    msg = f"{err['msg']} (got {err.get('input')!r})"
                problems.append(Problem(f"{where}.params.{loc}", msg))
            return None, problems

    def __reduce_ex__(self, protocol: Any) -> Any:
        """An operator importable by its `ref` pickles as that reference: the job's spec then pickles with plain
        pickle, without copying the function and its dynamic pydantic params model by value (cloudpickle did,
        and a copy made while another thread used the model once failed with "dictionary changed size during
        iteration" when a Dask worker sent a spec on). Only PlexRL's own operators, which every worker has;
        a user's operator pickles by value as before (its module may not be importable on the workers)."""
        module, _, attr = self.ref.partition(":")
        mod = sys.modules.get(module)
        if _built_in(module) and mod is not None and getattr(mod, attr, None) is self:
            return _operator_at, (module, attr)
        return super().__reduce_ex__(protocol)

    def run(self, ctx: OpContext, inputs: dict[str, Batch], params: BaseModel) -> Batch:
        kwargs: dict[str, Any] = {name: inputs.get(name) for name in self.inputs}
        if self.ctx_arg:
            kwargs[self.ctx_arg] = ctx
        # the validated values themselves (a nested model keeps which fields it was given: `train`'s parts)
        kwargs.update({name: getattr(params, name) for name in type(params).model_fields})
        out = self.fn(**kwargs)
        if not isinstance(out, self.output):
            raise TypeError(f"operator {self.ref} returned {type(out).__name__}, declared {self.output.__name__}")
        return out

    def __repr__(self) -> str:
        return f"Operator({self.ref}, runs_on={self.runs_on!r})"


def _port_type(hint: Any) -> tuple[type[Batch] | None, bool]:
    if isinstance(hint, type) and issubclass(hint, Batch):
        return hint, False
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], Batch):
            return args[0], True
    return None, False


def operator(
    runs_on: RunsOn | None = None,
    name: str | None = None,
    *,
    inline: bool = True,
    chunk_input: str | None = None,
    sliceable: bool = False,
    moved: dict[str, str] | None = None,
    placement: object = None,
) -> Callable[[Callable[..., Batch]], Operator]:
    """Decorator turning a typed function into an `Operator` (see the module docstring). `runs_on`: "service"
    or "cpu" (required). `inline=False` keeps a cpu operator on the CPU pool even when it is fast (the
    DaskDriver otherwise runs CPU nodes observed under `inline_below` in the driver process): use it for tool
    calls and anything that runs untrusted code. `chunk_input`: the input a chunked node slices by rows (a
    chunkable service operator, see above). `sliceable`: a service operator whose generation runs in slices of
    decode steps when its node is in the job's `slices` (it generates through
    `plexrl.engines.slicing.generate_slice` with `ctx.slice`). `moved`: former parameter -> the sentence
    naming what replaces it (a config that still sets one gets that error). `placement`: the former name of
    `runs_on`, refused with a TypeError that names it ("placement" is where a job goes)."""
    if placement is not None:
        raise TypeError(
            f"@operator(placement={placement!r}) is now @operator(runs_on={placement!r}): where a node runs is "
            "`runs_on` ('service' or 'cpu'); 'placement' names where a job goes (the planner's placement policy)"
        )
    if runs_on is None:
        raise TypeError("@operator needs runs_on='service' (in the job's LLM service) or runs_on='cpu' (the CPU pool)")
    where: RunsOn = runs_on

    def wrap(fn: Callable[..., Batch]) -> Operator:
        return Operator(fn, where, name, inline=inline, chunk_input=chunk_input, sliceable=sliceable, moved=moved)

    return wrap


# Built-in operators by short name; modules are imported only when an operator is used.
BUILTIN_OPERATORS: dict[str, str] = {
    "sample_prompts": "plexrl.operators.data:sample_prompts",
    "rollout": "plexrl.operators.rollout:rollout",
    "logprob": "plexrl.operators.rollout:logprob",
    "verify": "plexrl.operators.verify:verify",
    "remote_verify": "plexrl.operators.external:remote_verify",
    "grpo_advantage": "plexrl.operators.advantage:grpo_advantage",
    "rloo_advantage": "plexrl.operators.advantage:rloo_advantage",
    "reinforce_pp_advantage": "plexrl.operators.advantage:reinforce_pp_advantage",
    "overlong_penalty": "plexrl.operators.shaping:overlong_penalty",
    "keep_informative": "plexrl.operators.sampling:keep_informative",
    "refill_prompts": "plexrl.operators.sampling:refill_prompts",
    "pool_rollouts": "plexrl.operators.sampling:pool_rollouts",
    "pool_rewards": "plexrl.operators.sampling:pool_rewards",
    "value_estimate": "plexrl.operators.critic:value_estimate",
    "gae_advantage": "plexrl.operators.critic:gae_advantage",
    "train_critic": "plexrl.operators.critic:train_critic",
    "train": "plexrl.operators.train:train",
    "evaluate": "plexrl.operators.evaluate:evaluate",
    "start_episodes": "plexrl.operators.tools:start_episodes",
    "agent_turn": "plexrl.operators.tools:agent_turn",
    "call_tools": "plexrl.operators.tools:call_tools",
    "finish_episodes": "plexrl.operators.tools:finish_episodes",
    "evaluate_agent": "plexrl.operators.tools:evaluate_agent",
}


def resolve_operator(ref: str | Operator) -> Operator:
    """Find an operator by built-in name (`verify`) or dotted path (`mypkg.ops:length_penalty`).

    Raises LookupError with a message that says what to write instead.
    """
    if isinstance(ref, Operator):
        return ref
    builtin = ":" not in ref
    if builtin:
        if ref not in BUILTIN_OPERATORS:
            close = difflib.get_close_matches(ref, BUILTIN_OPERATORS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise LookupError(
                f"unknown operator {ref!r}; {hint}built-in operators: {', '.join(sorted(BUILTIN_OPERATORS))}; "
                "a user operator is named by dotted path, e.g. 'mypkg.ops:length_penalty'"
            )
        ref = BUILTIN_OPERATORS[ref]
    from plexrl.roles import resolve

    obj: Operator = resolve(ref, "operator", builtin=builtin)  # LookupError with the fix in words
    return obj
