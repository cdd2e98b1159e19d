"""The training config's schema: every section of `rlvr train`'s YAML as a typed model, its
checks across sections, and the method registry's side that picks `algorithm.<name>`'s section.

Every option is a typed field with a one-line description and a default from the field's practice;
an unknown key, a wrong type or an impossible value fails at load with the dotted key named.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import pkgutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    create_model,
    model_validator,
)

from rlvr.config.core import (
    ConfigError,
    Overrides,
    Section,
    apply_overrides,
    format_validation_error,
    key_tree,
    override_items,
    read_yaml_sections,
    vllm_on_cpu,
)
from rlvr.envs.hosted import check_environment_class
from rlvr.envs.rollout import EnvSettings
from rlvr.envs.tools import load_tools
from rlvr.generation.base import SamplingParams
from rlvr.tasks.prompts import PROMPT_SLOT
from rlvr.training.settings import LoraSettings
from rlvr.verifiers.python import check_function
from rlvr.verifiers.weighted import reward_name
from rlvr.verifiers.worker import plugin_name


def _plugin(value: Any) -> str | Callable[..., Any]:
    if isinstance(value, str) or callable(value):
        return value
    raise ValueError(f"{value!r:.80} is neither 'package.module:name' nor callable")


Plugin = Annotated[
    str | Callable[..., Any],
    PlainValidator(_plugin),
    PlainSerializer(plugin_name, when_used="json"),
]
"""A user plug-in (a reward function, a tool, an environment class): `"package.module:name"`,
imported where it runs, or, from
Python, the object itself, which reaches the actors by Ray's serialization (cloudpickle: a function
defined in a notebook travels by value). A saved config (a run's config.yaml) names an object by
`plugin_name`, which a later process can import only when the object lives in a module."""


class LoraConfig(Section):
    enabled: bool = Field(False, description="Train a PEFT LoRA adapter instead of all weights.")
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="LoRA dropout (0 keeps runs bitwise reproducible)."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        description="Module names that receive adapters.",
    )
    top_layers: int | None = Field(
        None,
        gt=0,
        description="Adapt only the last N decoder layers; backward then stops above the frozen "
        "lower layers, which cuts the step's compute (None = every layer).",
    )

    def settings(self) -> LoraSettings:
        """The trainer's form of this section (`enabled` decides whether it is used at all)."""
        return LoraSettings(
            r=self.r,
            alpha=self.alpha,
            dropout=self.dropout,
            target_modules=tuple(self.target_modules),
            top_layers=self.top_layers,
        )


class ModelConfig(Section):
    path: str = Field(
        "tiny",
        description="'tiny' or 'tiny-llama' (a small Qwen2 or Llama built locally), 'smollm2' "
        "(bundled), or a local HF directory.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weights dtype for training and generation."
    )
    seed: int = Field(0, description="Seed for building the tiny model.")
    sft_warmup_steps: int = Field(
        0,
        ge=0,
        description="Supervised warm-up steps on reference solutions, full fine-tuning of any "
        "model (tiny or real), cached by content.",
    )
    sft_warmup_lr: float = Field(
        1e-3,
        gt=0.0,
        description="Peak learning rate of the warm-up (1e-3 suits the tiny model; a pretrained "
        "one wants ~1e-5 to 1e-4).",
    )
    sft_warmup_batch_size: int = Field(16, gt=0, description="Solutions per warm-up step.")
    sft_warmup_problems: int | None = Field(
        None,
        gt=0,
        description="Training problems the warm-up draws from (None: task.n_train), so RL can "
        "keep a small recurring prompt pool while the warm-up sees many.",
    )
    sft_warmup_traces: Literal["solutions", "tool_calls"] = Field(
        "solutions",
        description="What the warm-up imitates: the reference solutions, or (env.kind 'tools') "
        "traces that call the calculator and then answer, rendered as rollouts render them "
        "(rlvr/envs/traces.py).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)


class DifficultyConfig(Section):
    min_steps: int = Field(
        1,
        ge=1,
        description="Fewest operations per problem (arithmetic; code: the function's steps).",
    )
    max_steps: int = Field(
        2, ge=1, description="Most operations per problem (arithmetic; code: up to 3)."
    )
    max_operand: int = Field(20, ge=1, description="Largest operand.")
    max_multiplier: int = Field(
        5, ge=2, description="Largest factor of a product (arithmetic; also <= max_operand)."
    )
    operators: str = Field("+-", min_length=1, description="Allowed operators, a subset of '+-*'.")
    style: Literal["expression", "words", "mixed"] = Field(
        "expression", description="Plain expressions or word problems."
    )
    verbosity: int = Field(
        0, ge=0, description="Up to N re-check lines per step in reference solutions (verbose SFT)."
    )
    reasoning: Literal["short", "long"] = Field(
        "short",
        description="Reference-solution style (arithmetic): 'long' writes every step out, slips "
        "and corrects some, and always ends in \\boxed{} (the reasoning start of DUET's regime).",
    )

    @model_validator(mode="after")
    def _check(self) -> DifficultyConfig:
        if self.max_steps < self.min_steps:
            raise ValueError("max_steps must be >= min_steps")
        if set(self.operators) - set("+-*"):
            raise ValueError("operators may only contain '+', '-', '*'")
        return self


class FieldMap(Section):
    """Our field names mapped onto a dataset's column names (task.fields)."""

    id: str | None = Field(None, description="Column of the problem's id (none: derived).")
    prompt: str | None = Field(
        None, description="Column of the prompt: text, or a list of chat messages."
    )
    answer: str | None = Field(
        None, description="Column of the gold answer (GSM8K '####' and \\boxed recognised)."
    )
    solution: str | None = Field(None, description="Column of a worked solution (SFT warm-up).")
    reference: str | None = Field(
        None, description="Column of the reference answer (reference_file); in file: a solution."
    )
    tests: str | None = Field(
        None,
        description="Column of a code task's tests (assert sources): the answer becomes "
        '{"asserts": [...]} as JSON text. Instead of answer.',
    )

    def mapping(self) -> dict[str, str]:
        """Our name -> the dataset's column, for the names mapped."""
        return self.model_dump(exclude_none=True)

    @model_validator(mode="after")
    def _check(self) -> FieldMap:
        if self.tests is not None and self.answer is not None:
            raise ValueError("map either answer or tests (a code task's answer), not both")
        if any(not v for v in self.mapping().values()):
            raise ValueError("column names must be non-empty")
        return self


class TaskConfig(Section):
    name: Literal["arithmetic", "code", "explain", "file", "reference_file"] = Field(
        "arithmetic",
        description="Procedural task ('arithmetic'; 'code': write f(x), assert tests for "
        "verifier.kind 'code'; 'explain': reference answers, no verifier) or "
        "a user dataset file ('file': id/prompt/answer; 'reference_file': id/prompt/reference).",
    )
    train_path: str | None = Field(
        None,
        description="Training data when name is 'file' or 'reference_file': JSONL, parquet or "
        "arrow, a directory of shards or of datasets.save_to_disk, or a glob pattern.",
    )
    test_path: str | None = Field(
        None, description="Held-out data when name is 'file' or 'reference_file' (as train_path)."
    )
    fields: FieldMap = Field(
        default_factory=FieldMap,
        description="Our field names mapped onto the dataset's columns ({prompt: question}); "
        "none mapped: the layout is recognised (ours, GSM8K, MATH, MBPP, HumanEval).",
    )
    difficulty: DifficultyConfig = Field(default_factory=DifficultyConfig)
    n_train: int = Field(2000, gt=0, description="Procedural training problems.")
    n_test: int = Field(100, gt=0, description="Procedural held-out problems.")
    seed: int = Field(0, description="Task generation seed.")
    instruction: str = Field(
        "Put your final answer in \\boxed{}.",
        description=(
            "Appended to every problem; or, when it contains {prompt}, a template the problem's "
            "text fills (few-shot examples before it, e.g. for raw prompts)."
        ),
    )
    chat_template: bool = Field(
        True,
        description="Render prompts through the tokenizer's chat template; false: the raw text "
        "(DRO trains so; a base model without a template needs it).",
    )

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.name in ("file", "reference_file") and not self.train_path:
            raise ValueError(f"train_path is required when name='{self.name}'")
        if self.fields.mapping():
            if self.name not in ("file", "reference_file"):
                raise ValueError(f"fields apply to dataset files, not name='{self.name}'")
            if self.name == "reference_file" and self.fields.tests is not None:
                raise ValueError("fields.tests applies to name='file' (code tasks), not reference")
        if self.instruction.count(PROMPT_SLOT) > 1:
            raise ValueError(f"instruction holds {PROMPT_SLOT} more than once")
        return self

    def cache_key(self) -> dict[str, Any]:
        """The task's settings for cache keys; an empty field map and the default reasoning are
        left out, so keys made before task.fields / difficulty.reasoning existed still match."""
        exclude: dict[str, Any] = {} if self.fields.mapping() else {"fields": True}
        defaults = {"reasoning": "short", "max_multiplier": 5}
        unchanged = {k for k, v in defaults.items() if getattr(self.difficulty, k) == v}
        if unchanged:
            exclude["difficulty"] = unchanged  # likewise for keys made before these fields
        return self.model_dump(mode="json", exclude=exclude or None)


class GenerationConfig(Section):
    backend: Literal["vllm", "hf"] = Field(
        "vllm", description="Generation engine; 'hf' is the transformers fallback."
    )
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature for rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(256, gt=0, description="Longest response in tokens.")
    stop: list[str] = Field(
        default_factory=list,
        description=(
            "Stop strings: a rollout ends with the token that completes one (kept in the "
            "trained tokens, cut from the verified text), e.g. the next 'Question:' of a few-shot "
            "raw prompt. Training, held-out evaluation and DRO's filter all use them."
        ),
    )
    max_model_len: int = Field(
        1024, gt=0, description="Prompt + response context the engine reserves."
    )
    group_size: int = Field(8, gt=0, description="Rollouts per prompt (GRPO group).")
    prompts_per_step: int = Field(8, gt=0, description="Prompts per training step.")
    kv_cache_gib: float = Field(1.0, gt=0.0, description="KV cache size for vLLM on CPU.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description=(
            "Weights and KV cache dtype of the rollout engines; auto: model.dtype. bfloat16 under "
            "float32 training halves the engines' memory and, on CPUs with AMX or AVX512-BF16, "
            "their decode time; the engine/trainer mismatch it adds is what training.engine_is "
            "corrects, as verl and OpenRLHF do for bf16 vLLM beside an fp32 master copy."
        ),
    )
    enforce_eager: bool = Field(
        False, description="Skip vLLM's torch.compile: starts faster, decodes slower."
    )
    engine_loop: Literal["requests", "batch"] = Field(
        "requests",
        description=(
            "How vLLM engines sample: 'requests' drives the engine request by request "
            "(continuous batching, as multi-turn rollouts need); 'batch' hands a step's samples "
            "to one lock-step LLM.generate call. Both sample the same tokens for the same seeds."
        ),
    )
    eval_samples: int = Field(1, gt=0, description="Samples per held-out problem (mean@k).")
    eval_temperature: float = Field(0.0, ge=0.0, description="Temperature for held-out evaluation.")

    def sampling_params(
        self, seed: int | None, temperature: float | None = None, top_p: float | None = None
    ) -> SamplingParams:
        """The rollout sampler (its temperature and top-p unless given) with the stop strings
        every pass shares."""
        return SamplingParams(
            temperature=self.temperature if temperature is None else temperature,
            top_p=self.top_p if top_p is None else top_p,
            max_tokens=self.max_tokens,
            seed=seed,
            stop=tuple(self.stop),
        )

    @model_validator(mode="after")
    def _check(self) -> GenerationConfig:
        if self.max_tokens >= self.max_model_len:
            raise ValueError("max_tokens must be < max_model_len (the prompt needs room)")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty (an empty one would match at once)")
        return self


class TrainingConfig(Section):
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0.0, description="Global gradient-norm clip.")
    micro_batch_size: int = Field(
        8, gt=0, description="Sequences per forward/backward micro-batch."
    )
    lm_head_chunk: int = Field(
        0,
        ge=0,
        description=(
            "Apply the LM head only at loss tokens, this many at a time, recomputing each chunk "
            "in backward: no [tokens x vocabulary] logits tensor. 0: the full logits."
        ),
    )
    shared_prefix: bool = Field(
        False,
        description=(
            "Run each prompt once for the rows of a micro-batch that share it (a GRPO group), "
            "every response behind it under a block mask: the same log-probs and gradients for "
            "fewer tokens (Prefix Grouper, arXiv:2506.05433). Needs sdpa or eager attention."
        ),
    )
    gradient_checkpointing: bool = Field(
        False,
        description=(
            "Keep only each decoder layer's input in forward and recompute the layer in backward "
            "(activation checkpointing): the step's activations shrink to about one layer's, for "
            "one more forward pass of training time (bench/vs_trl.py measures both)."
        ),
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description=(
            "Token budget per micro-batch (rows x longest row, prompt included), replacing "
            "micro_batch_size: rows are grouped longest first so short ones are not padded to "
            "long ones (verl's dynamic batch size). 0: micro_batch_size rows in batch order."
        ),
    )
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the k3 KL to the reference policy.")
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO ratio clip below 1.")
    clip_high: float = Field(
        0.2, gt=0.0, description="PPO ratio clip above 1 (DAPO clip-higher uses 0.28)."
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses (policy and KL) are averaged."
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per rollout batch, each on its own slice (PPO mini-batches, "
        "verl's ppo_mini_batch_size); above 1 the clipped ratio acts.",
    )
    epochs: int = Field(
        1, ge=1, description="Passes over each rollout batch (verl ppo_epochs, TRL num_iterations)."
    )
    engine_is: Literal["off", "tis", "mask"] = Field(
        "tis",
        description="Engine/trainer mismatch correction per token, rho = pi_old / engine: 'tis' "
        "weights by min(rho, cap), 'mask' drops tokens with rho > cap, 'off' only measures it.",
    )
    engine_is_cap: float = Field(2.0, ge=1.0, description="Cap C of the engine importance ratio.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate decay after the warm-up, to min_lr_ratio * lr."
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear lr warm-up.")
    warmup_ratio: float = Field(
        0.0, ge=0.0, lt=1.0, description="Warm-up as a share of all optimizer steps (or steps)."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Final lr of a linear or cosine decay, as a share of lr."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        return self


OLD_METHOD_SWITCHES = {m: m for m in ("laconic", "duet", "dro", "tandem")} | {
    "dynamic_sampling": "dapo"
}
"""Sections whose `enabled` flag used to switch a method on, and the `algorithm.name` now."""


def _old_switch_error(section: str, assign: str) -> str:
    """What replaced `algorithm.<section>.enabled` (`assign`: '=' for --set, ': ' for YAML)."""
    method = OLD_METHOD_SWITCHES[section]
    return (
        f"algorithm.{section}.enabled: methods are chosen by algorithm.name; "
        f"write algorithm.name{assign}{method}"
    )


@dataclass(frozen=True)
class MethodSpec:
    """What the training config needs of a method (`rlvr.methods.base.register` records it)."""

    section: type[Section] | None = None
    """Its parameters, `algorithm.<name>` (None: it has none of its own)."""
    check: Callable[[Config], None] | None = None
    """Its checks across sections, run once the whole config is valid (raise ValueError)."""
    overlaps_generation: bool = True
    """Whether step t+1's rollouts may be collected while step t trains."""
    engine_state: bool = False
    """Whether it keeps per-sample state in the engine's process (a stop rule, an author
    schedule), which tensor-parallel engine workers cannot share."""
    single_turn: str | None = None
    """Why it cannot run multi-turn rollouts (`env`), if it cannot."""


_METHOD_SPECS: dict[str, MethodSpec] = {}


def _section_of(name: str) -> type[Section] | None:
    """The section model of the registered method `name` (None: no such method, or none)."""
    spec = _METHOD_SPECS.get(name)
    return None if spec is None else spec.section


def register_method_spec(name: str, spec: MethodSpec) -> None:
    """Make `algorithm.name: <name>` valid, with `spec`'s section and checks."""
    _METHOD_SPECS[name] = spec
    config_model.cache_clear()


def import_builtin_methods() -> None:
    """Import the `method` module of every package under rlvr/methods/ (each registers its
    method); cheap after the first call. A method defined elsewhere registers when its module
    is imported."""
    where = importlib.util.find_spec("rlvr.methods").submodule_search_locations
    for package in pkgutil.iter_modules(where, "rlvr.methods."):
        if package.ispkg and importlib.util.find_spec(f"{package.name}.method"):
            importlib.import_module(f"{package.name}.method")


def method_names() -> list[str]:
    """Every registered method's name."""
    import_builtin_methods()
    return sorted(_METHOD_SPECS)


def method_spec(name: str) -> MethodSpec:
    """The registered method `name`'s spec; ValueError naming the registered ones."""
    if name not in _METHOD_SPECS:
        import_builtin_methods()
    if name not in _METHOD_SPECS:
        raise ValueError(
            f"algorithm.name: unknown method {name!r}; choose one of {', '.join(method_names())}"
        )
    return _METHOD_SPECS[name]


class AlgorithmConfig(Section):
    """The training method (`name`) and its parameters, in the section of the same name that
    the method brings (`config_model`)."""

    name: str = Field(
        "grpo",
        description="Training method: grpo, laconic (length budget), duet (rollout budget), dro "
        "(reference reward), tandem (junior co-writer), dapo (dynamic sampling), or a registered "
        "one; its parameters are in the section of the same name.",
    )
    advantage_scale: Literal["group", "none"] = Field(
        "group", description="'group' divides by group std; 'none' is Dr.GRPO."
    )
    advantage_eps: float = Field(1e-6, gt=0.0, description="Added to the group std.")

    @model_validator(mode="before")
    @classmethod
    def _sections_of_other_methods(cls, data: Any) -> Any:
        # Methods used to be switched on by flags; say what replaces them instead of "unknown key".
        # The sections of methods other than the chosen one (a preset's, with algorithm.name
        # overridden) are checked by their own models, naming a bad key, and then left out.
        if not isinstance(data, dict):
            return data
        for section in OLD_METHOD_SWITCHES:
            given = data.get(section)
            if isinstance(given, dict) and "enabled" in given:
                raise ValueError(_old_switch_error(section, ": "))
        name = data.get("name", "grpo")
        inactive = {key for key in data if key != name and _section_of(key) is not None}
        for key in inactive:
            try:
                _section_of(key).model_validate(data[key])
            except ValidationError as err:
                raise ValueError(format_validation_error(err, f"algorithm.{key}")) from None
        return {k: v for k, v in data.items() if k not in inactive}

    @model_validator(mode="after")
    def _known_method(self) -> AlgorithmConfig:
        method_spec(self.name)
        return self


class RewardConfig(Section):
    kind: Literal["math", "code", "python"] = Field(
        description="The component's verifier: 'math', 'code' or 'python' (a plug-in)."
    )
    weight: float = Field(1.0, description="Its weight in the step's reward (a weighted sum).")
    function: Plugin | None = Field(
        None,
        description="The plug-in's 'package.module:fn', or from Python the function itself "
        "(kind 'python' only).",
    )
    name: str | None = Field(
        None,
        description="Its name in the metrics (reward/<name>_mean); default: the function's name "
        "(python), else the kind.",
    )


class VerifierConfig(Section):
    kind: Literal["math", "code", "python"] = Field(
        "math",
        description="Reward function: 'math' compares the final answer with math-verify; 'code' "
        "runs the response's last ```python block against the tests in the gold (JSON: "
        '{"asserts": [...]} or {"io": [{"input", "output"}]}) in a sandbox; \'python\' calls '
        "verifier.function, a plug-in fn(prompts, responses, golds, metadata) returning a reward "
        "or a (reward, status) pair per response, a batch per call within timeout_s (shipped "
        "examples: rlvr.verifiers.rewards:boxed_format, 1.0 when the response ends with a "
        "\\boxed{} answer; rlvr.verifiers.rewards:keyword_coverage, the share of the problem's "
        "metadata keywords it mentions).",
    )
    function: Plugin | None = Field(
        None,
        description="The reward plug-in of kind 'python', 'package.module:fn' (importable where "
        "the run starts and in its verifier actors), or from Python the function itself (it "
        "reaches the actors by Ray's serialization).",
    )
    rewards: list[RewardConfig] = Field(
        default_factory=list,
        description="Several rewards with weights instead of one kind (which then stays math, "
        "unused), e.g. [{kind: math, weight: "
        "1.0}, {kind: python, function: 'rlvr.verifiers.rewards:boxed_format', weight: 0.2}]: "
        "the reward is the weighted sum, the status the first entry's, and each entry's mean is "
        "logged as reward/<name>_mean.",
    )
    num_workers: int = Field(1, gt=0, description="Verifier worker processes per VerifierActor.")
    timeout_s: float = Field(5.0, gt=0.0, description="Hard per-item verification timeout.")
    unsafe_hook_sandbox: bool = Field(
        False,
        description="Where namespaces do not work (unshare(2) refused: an unprivileged "
        "container), run code rewards under the audit-hook sandbox instead of refusing to start. "
        "That hook lives in the program's own interpreter: a program that means to can get round "
        "it, read the host's files and reach the network (docs/guides/bring-your-own.md, 'Code "
        "rewards').",
    )
    max_uncomputed_share: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Largest share of a step's rewards left uncomputed (status 'verifier_failed': "
        "their actor died on every re-run; or a multi-turn trajectory's environment failed, status "
        "its end reason: env_error, env_timeout, env_bad_result, env_crashed, callback_error, "
        "callback_timeout); past it the step fails before its update. 0 tolerates none, 1 never "
        "fails.",
    )

    @model_validator(mode="after")
    def _check_rewards(self) -> VerifierConfig:
        if self.rewards:
            # kind keeps its default: a saved config (the run's, on --resume) holds it too
            if self.kind != "math" or self.function is not None:
                raise ValueError(
                    "verifier.rewards: set either verifier.rewards or verifier.kind (and "
                    "verifier.function), not both"
                )
            names: set[str] = set()
            for i, r in enumerate(self.rewards):
                key = f"verifier.rewards.{i}"
                if not math.isfinite(r.weight):
                    raise ValueError(f"{key}.weight: must be a finite number, got {r.weight}")
                _check_function(r.kind, r.function, f"{key}.function")
                name = reward_name(r.kind, r.function, r.name)
                if name in names:
                    raise ValueError(f"{key}.name: {name!r} names an earlier entry too; name each")
                names.add(name)
        else:
            _check_function(self.kind, self.function, "verifier.function")
        return self

    def kinds(self) -> set[str]:
        """The verifier kinds the run scores with (one, or those of `rewards`)."""
        return {r.kind for r in self.rewards} if self.rewards else {self.kind}

    def verifier_kwargs(self) -> dict[str, Any]:
        """`make_verifier`'s kind, function, rewards and sandbox choice (plain data, for the
        actors)."""
        return {
            "kind": self.kind,
            "function": self.function,
            "rewards": [r.model_dump() for r in self.rewards],
            "unsafe_hook_sandbox": self.unsafe_hook_sandbox,
        }


def _check_function(kind: str, function: str | Callable[..., Any] | None, key: str) -> None:
    """A python reward needs a function (importable by name, or a callable that pickles); the other
    kinds take none."""
    if kind != "python":
        if function is not None:
            raise ValueError(f"{key}: only kind 'python' takes a function (this is {kind!r})")
        return
    if function is None or function == "":
        raise ValueError(f"{key}: kind 'python' needs a function, 'package.module:fn'")
    try:
        check_function(function)
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from None


Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
"""A Ray placement group strategy."""


DEFAULT_JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000"
"""jemalloc's tuning for the model actors (see ResourcesConfig.jemalloc_conf)."""


class ResourcesConfig(Section):
    policy_ranks: int = Field(
        1, ge=1, description="Data-parallel DeepSpeed ranks of the policy, one PolicyActor each."
    )
    policy_cpus: float = Field(1.0, gt=0.0, description="CPUs reserved per policy rank.")
    policy_gpus: float = Field(0.0, ge=0.0, description="GPUs per policy rank.")
    generator_engines: int = Field(
        1, ge=1, description="Generation engines, one GeneratorActor each, sharing every step."
    )
    generator_tp: int = Field(
        1,
        ge=1,
        description=(
            "vLLM tensor parallelism per engine (worker processes of its own; on GPUs set "
            "generator_gpus to the same number). DUET's stop rule and Tandem's junior run in the "
            "engine's process, so they need 1."
        ),
    )
    generator_cpus: float = Field(1.0, gt=0.0, description="CPUs reserved per generation engine.")
    generator_gpus: float = Field(0.0, ge=0.0, description="GPUs per generation engine.")
    num_verifiers: int = Field(2, gt=0, description="VerifierActors in the pool.")
    verifier_cpus: float = Field(
        0.0, ge=0.0, description="CPUs reserved per VerifierActor (their work is I/O-light)."
    )
    torch_threads: int = Field(
        0,
        ge=0,
        description=(
            "Torch threads per model actor (0: the cores shared by the actors of one role that "
            "compute at once, all of them with one rank and one engine)."
        ),
    )
    malloc_mmap_threshold_kib: int = Field(
        0,
        ge=0,
        le=32768,
        description=(
            "glibc's malloc in the policy ranks and engines: allocations of at least this many "
            "KiB get a mapping of their own, returned to the system when freed (0: glibc's "
            "default, a threshold that rises with use to 32 MiB and keeps freed tensors on a "
            "fragmenting heap). Less memory for more page faults: 1024 cut a SmolLM2 policy step's "
            "peak by 0.75 GiB at 1.34x its time. Elsewhere than glibc it does nothing."
        ),
    )
    allocator: Literal["glibc", "jemalloc"] = Field(
        "glibc",
        description=(
            "The policy ranks' and engines' malloc: the C library's, or jemalloc (Ray's bundled "
            "libjemalloc.so, or the file named by RAY_JEMALLOC_LIB_PATH, preloaded into those "
            "actors' processes; they must find it at the same path on every node). Actors only: "
            "an in-process run keeps the allocator its process started with."
        ),
    )
    jemalloc_conf: str = Field(
        DEFAULT_JEMALLOC_CONF,
        description=(
            "MALLOC_CONF for resources.allocator: jemalloc (empty: jemalloc's defaults). The "
            "default returns freed pages to the system after 1 s from a thread of jemalloc's own, "
            "off the training path: on a SmolLM2 policy step it peaked 0.8 GiB below glibc at "
            "glibc's step time, where jemalloc's defaults (10 s) cost 1.1x and immediate return "
            "(dirty_decay_ms:0) 1.5x."
        ),
    )
    policy_resources: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Custom node resources per policy rank (e.g. {rlvr_train: 1} to place ranks only on "
            "nodes started with `ray start --resources='{\"rlvr_train\": 8}'`)."
        ),
    )
    generator_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom node resources per generation engine (e.g. {rlvr_rollout: 1}).",
    )
    placement_strategy: Strategy = Field(
        "PACK",
        description=(
            "Placement group strategy over the model actors' bundles (one per policy rank, then "
            "one per engine; with colocate one per pair): STRICT_SPREAD puts each on its own node."
        ),
    )
    policy_strategy: Strategy | None = Field(
        None,
        description=(
            "Set (with or without generator_strategy) to give each role a placement group of its "
            "own: the policy ranks' strategy (e.g. STRICT_PACK: all ranks on one node)."
        ),
    )
    generator_strategy: Strategy | None = Field(
        None,
        description=(
            "The engines' strategy in a group of their own (e.g. SPREAD); the unset role takes "
            "placement_strategy."
        ),
    )
    colocate: bool = Field(
        False,
        description=(
            "Policy rank i and engine i share one bundle (one node; on GPUs one device, "
            "policy_gpus + generator_gpus <= 1): needs policy_ranks == generator_engines x "
            "generator_tp. Weights then pass rank to engine on the device (sync.transport "
            "colocated) and, on GPUs, the engine sleeps while its rank trains (engine_sleep)."
        ),
    )
    engine_sleep: Literal["offload", "discard", "off"] = Field(
        "offload",
        description=(
            "Colocated on GPUs, vLLM's sleep mode around every update: offload (level 1: weights "
            "to host memory, KV cache freed), discard (level 2: both freed; the sync rewrites "
            "every weight), off. CPU engines free their KV cache around every update at either "
            "level (vLLM's sleep mode needs a GPU; their weights stay), unless "
            "run.max_staleness is above 0 (they sample during the update)."
        ),
    )

    @model_validator(mode="after")
    def _check_allocator(self) -> ResourcesConfig:
        if self.allocator == "jemalloc" and self.malloc_mmap_threshold_kib:
            raise ValueError(
                "resources.malloc_mmap_threshold_kib tunes glibc's malloc; with resources.allocator: "
                "jemalloc leave it 0 (tune jemalloc with resources.jemalloc_conf)"
            )
        if self.allocator == "glibc" and self.jemalloc_conf != DEFAULT_JEMALLOC_CONF:
            raise ValueError("resources.jemalloc_conf needs resources.allocator: jemalloc")
        return self

    @model_validator(mode="after")
    def _check_colocate(self) -> ResourcesConfig:
        if not self.colocate:
            return self
        pairs = self.generator_engines * self.generator_tp
        if self.policy_ranks != pairs:
            raise ValueError(
                f"resources.colocate pairs policy rank i with engine i, so resources.policy_ranks "
                f"({self.policy_ranks}) must equal generator_engines x generator_tp ({pairs})"
            )
        if self.generator_tp != 1:
            raise ValueError(
                "resources.colocate: a tensor-parallel engine would span the devices of several "
                "ranks, which colocation does not place; use generator_tp: 1 (more engines "
                "scale generation instead)"
            )
        if self.policy_strategy is not None or self.generator_strategy is not None:
            raise ValueError(
                "resources.colocate puts both roles in one group of pairs; leave "
                "resources.policy_strategy and generator_strategy unset (use placement_strategy)"
            )
        if bool(self.policy_gpus) != bool(self.generator_gpus):
            raise ValueError(
                "resources.colocate: policy_gpus and generator_gpus must both be > 0 (sharing a "
                "device) or both 0 (CPU)"
            )
        if self.policy_gpus + self.generator_gpus > 1.0 + 1e-9:
            raise ValueError(
                f"resources.colocate: policy_gpus + generator_gpus = "
                f"{self.policy_gpus + self.generator_gpus:g} asks for more than the one device a "
                "pair shares (e.g. 0.5 each)"
            )
        return self

    @property
    def bundles(self) -> int:
        """Model actor bundles over all placement groups: one per policy rank and one per engine,
        or one per pair when colocated."""
        return self.policy_ranks if self.colocate else self.policy_ranks + self.generator_engines

    @property
    def engines_sleep(self) -> bool:
        """Whether engines sleep while their colocated rank trains (GPUs only)."""
        return self.colocate and self.generator_gpus > 0 and self.engine_sleep != "off"

    def policy_bundle(self) -> dict[str, float]:
        """One policy rank's bundle of the run's placement group."""
        return _bundle(self.policy_cpus, self.policy_gpus, self.policy_resources)

    def generator_bundle(self) -> dict[str, float]:
        """One engine's bundle of the run's placement group."""
        return _bundle(self.generator_cpus, self.generator_gpus, self.generator_resources)

    def demand(self, verifiers: bool = True, companion_engines: int = 0) -> dict[str, float]:
        """Every resource the run's actors reserve, summed (`verifiers`: with the verifier pool,
        which sits outside the model actors' placement group; `companion_engines`: engines with
        an engine's bundle beside the engines, such as Tandem's separate juniors)."""
        need: dict[str, float] = {}

        def add(resources: dict[str, float], times: int) -> None:
            for key, value in resources.items():
                need[key] = need.get(key, 0.0) + value * times

        add(self.policy_bundle(), self.policy_ranks)
        add(self.generator_bundle(), self.generator_engines + companion_engines)
        if verifiers:
            add({"CPU": self.verifier_cpus}, self.num_verifiers)
        return {k: v for k, v in need.items() if v > 0}


def _bundle(cpus: float, gpus: float, custom: dict[str, float]) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **custom}


class SyncConfig(Section):
    """How new policy weights reach the generation engines after every step."""

    transport: Literal["auto", "object_store", "collective", "colocated"] = Field(
        "auto",
        description=(
            "object_store: one host copy of the weights through Ray's object store; collective: "
            "a bucketed broadcast from policy rank 0 to every engine (gloo on CPU, NCCL on GPU); "
            "colocated (needs resources.colocate): each rank hands its own engine the weights "
            "bucket by bucket (CUDA IPC on a shared GPU, the node's shared memory on CPU); "
            "auto: colocated when colocated, else collective (the object store only for "
            "in-process workers)."
        ),
    )
    bucket_mb: float = Field(
        64.0, gt=0.0, description="Bucket size of the collective and colocated syncs, in MiB."
    )


class EnvConfig(Section):
    """Multi-turn rollouts (agents): the model acts over several turns, answered by tools or an
    environment between them; 'none' keeps one completion per rollout."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, serialize_by_alias=True
    )

    kind: Literal["none", "tools", "python"] = Field(
        "none",
        description="'tools': the built-in tool-calling loop over `tools`; 'python': a class of "
        "your own (`class`) with reset(problem) -> messages and step(message) -> (observations, "
        "reward or None, done); 'none': single-turn rollouts.",
    )
    tools: list[Plugin] = Field(
        default_factory=list,
        description="Tool functions, 'package.module:fn' or, from Python, the functions "
        "themselves (name, docstring and type hints give the JSON schema); each call runs "
        "sandboxed like the code verifier.",
    )
    env_class: Plugin | None = Field(
        None,
        alias="class",
        description="The environment class, 'package.module:Cls' or, from Python, the class "
        "itself (kind 'python'); it runs in a process of its own per trajectory.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment class (JSON data)."
    )
    parser: Literal["hermes", "json"] = Field(
        "hermes",
        description="How tool calls are read from the model's text: 'hermes' "
        "(<tool_call>{json}</tool_call>) or 'json' (a bare JSON object).",
    )
    max_turns: int = Field(4, ge=1, description="The model's turns per trajectory at most.")
    max_tool_calls: int = Field(4, ge=1, description="Tool calls run per model turn at most.")
    token_budget: int | None = Field(
        None,
        gt=0,
        description="Tokens the model may write over all its turns (None: max_turns x "
        "generation.max_tokens); the context (generation.max_model_len) also ends a trajectory.",
    )
    tool_timeout_s: float = Field(5.0, gt=0.0, description="Wall-clock limit of one tool call.")
    tool_memory_mb: int = Field(256, gt=0, description="Memory of one tool call's processes.")
    env_timeout_s: float = Field(
        30.0, gt=0.0, description="Wall-clock limit of one reset or step of a python environment."
    )

    @model_validator(mode="after")
    def _check(self) -> EnvConfig:
        if self.kind == "tools":
            if not self.tools:
                raise ValueError("env.tools: kind 'tools' needs at least one 'package.module:fn'")
            try:
                load_tools(self.tools)
            except ValueError as err:
                raise ValueError(f"env.tools: {err}") from None
        elif self.tools:
            raise ValueError(f"env.tools: only kind 'tools' runs tools (this is {self.kind!r})")
        if self.kind == "python":
            if not self.env_class:
                raise ValueError("env.class: kind 'python' needs 'package.module:Cls'")
            try:
                check_environment_class(self.env_class)
            except ValueError as err:
                raise ValueError(f"env.class: {err}") from None
        elif self.env_class:
            raise ValueError(f"env.class: only kind 'python' takes a class (this is {self.kind!r})")
        return self

    @property
    def multi_turn(self) -> bool:
        return self.kind != "none"

    def settings(self, instruction: str, unsafe_hook: bool) -> EnvSettings:
        """The section as the engines' processes take it (`rlvr.envs.rollout.EnvSettings`)."""
        return EnvSettings(
            kind=self.kind,
            tools=tuple(self.tools),
            env_class=self.env_class,
            kwargs=dict(self.kwargs),
            parser=self.parser,
            max_turns=self.max_turns,
            max_tool_calls=self.max_tool_calls,
            token_budget=self.token_budget,
            tool_timeout_s=self.tool_timeout_s,
            tool_memory_mb=self.tool_memory_mb,
            env_timeout_s=self.env_timeout_s,
            instruction=instruction,
            unsafe_hook=unsafe_hook,
        )


RENAMED_OFF_POLICY_STEPS = (
    "off_policy_steps is now run.max_staleness (off_policy_steps: 1 is max_staleness: 1)"
)


class RunConfig(Section):
    name: str = Field(
        "run", min_length=1, description="Run name (used for the run directory and actor names)."
    )
    output_dir: str = Field("runs", description="Parent directory of run directories.")
    steps: int = Field(20, gt=0, description="Training steps.")
    seed: int = Field(0, description="Seed of data order, sampling and training.")
    eval_every: int = Field(
        10, ge=0, description="Held-out evaluation every N steps (0: only at start and end)."
    )
    keep_last: int = Field(
        2,
        gt=0,
        description="Step checkpoints to keep (the best by the method's validation metric is kept too).",
    )
    max_failures: int = Field(
        3,
        ge=0,
        description="Lost actors (a generator, verifier, policy rank or controller, or their "
        "node) the run recovers from by itself: it restarts its actors, restores the last "
        "committed step and redoes the step in flight, ending as an uninterrupted run would. "
        "One more stops the run with a committed state to resume.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        le=16,
        description=(
            "k: step t trains on rollouts sampled by policy version max(0, t - k) (the weights "
            "after that many updates), which the engines generate in a background pipeline "
            "while the policy trains; the engine importance weights of training.engine_is "
            "correct for the lag. 0: every step's rollouts come from the weights it trains "
            "(synchronous). 1: the next step's rollouts are sampled during this step's update. "
            "k >= 2 keeps up to k batches ahead, the engines loading held snapshots of the "
            "policy (sync.transport object_store, which auto then picks)."
        ),
    )
    partial_rollout_tokens: int = Field(
        0,
        ge=0,
        description=(
            "Partial rollouts (needs max_staleness >= 1): step t's trajectories sample their "
            "first this many model tokens with policy version max(0, t - k) and the rest with "
            "the next version, which the engines load between decode steps while every "
            "trajectory waits at that boundary; each sample records the versions of its tokens "
            "(flags policy_versions) and each token's engine log-prob is its own version's. "
            "0: a batch is sampled by one version."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_off_policy_steps(cls, data: Any) -> Any:
        # run.off_policy_steps: 1 became run.max_staleness: 1; say so instead of "unknown key"
        if isinstance(data, dict) and "off_policy_steps" in data:
            raise ValueError(RENAMED_OFF_POLICY_STEPS)
        return data

    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description=(
            "Where each step's numeric metrics go as well: tensorboard (tb/), wandb (wandb/, "
            "offline unless WANDB_MODE is set or an API key is configured; `wandb sync` uploads "
            "it), mlflow (a file store in mlruns/, or run.mlflow_uri). metrics.jsonl and "
            "eval.jsonl are always written (the run's record, which resume truncates) and need "
            "no entry. wandb and mlflow need `pip install 'rlvr[loggers]'`."
        ),
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (a server or database) instead of the run's mlruns/.",
    )

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        repeated = sorted({n for n in self.loggers if self.loggers.count(n) > 1})
        if repeated:
            raise ValueError(f"run.loggers: lists {', '.join(repeated)} more than once")
        return self


class Config(Section):
    """A training run's configuration: one section per key of the YAML (every key in the
    configuration reference), validated as a whole when built or changed."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.generation.group_size < 2:
            raise ValueError(
                "generation.group_size must be >= 2 (a group of one has no baseline for its "
                "advantage)"
            )
        if self.generation.temperature <= 0:
            raise ValueError(
                "generation.temperature must be > 0: rollouts are sampled, and the trainer's "
                "log-probs are those of softmax(logits / temperature)"
            )
        if self.task.name == "code" and "code" not in self.verifier.kinds():
            raise ValueError(
                "verifier.kind: task 'code' has assert tests for golds; set verifier.kind: code"
            )
        warmup, total = self.lr_schedule_steps()
        if self.training.lr_schedule != "constant" and total <= warmup:
            raise ValueError(
                f"training.warmup_steps: a {self.training.lr_schedule} lr schedule needs optimizer "
                f"steps after the warm-up ({warmup} of {total})"
            )
        self._check_tensor_parallel()
        if self.engine_dtype != self.model.dtype and self.training.engine_is == "off":
            warnings.warn(
                f"generation.dtype={self.engine_dtype} samples from other weights than the "
                f"{self.model.dtype} trainer; with training.engine_is=off nothing corrects the "
                "mismatch (tis or mask do)",
                stacklevel=2,
            )
        if self.sync.transport == "colocated" and not self.resources.colocate:
            raise ValueError(
                "sync.transport: colocated hands weights from each policy rank to the engine "
                "beside it; set resources.colocate: true or pick another transport"
            )
        if (
            self.sync.transport == "collective"
            and self.resources.colocate
            and self.resources.generator_gpus
        ):
            raise ValueError(
                "sync.transport: collective would put policy rank 0 and engine 0, which "
                "resources.colocate places on one GPU, in one NCCL group, and NCCL refuses two "
                "ranks on one device; use colocated (or auto)"
            )
        if self.run.max_staleness:
            self._check_staleness()
        if self.run.partial_rollout_tokens:
            self._check_partial_rollouts()
        spec = method_spec(self.algorithm.name)
        if self.env.multi_turn and spec.single_turn:
            raise ValueError(
                f"env.kind: {self.algorithm.name} runs single-turn rollouts only: {spec.single_turn}"
            )
        if self.model.sft_warmup_traces == "tool_calls" and self.env.kind != "tools":
            raise ValueError(
                "model.sft_warmup_traces: tool_calls traces call a tool of env.tools; "
                f"set env.kind: tools (it is {self.env.kind!r})"
            )
        if spec.check is not None:
            spec.check(self)
        return self

    def _check_staleness(self) -> None:
        k = self.run.max_staleness
        if not method_spec(self.algorithm.name).overlaps_generation:
            raise ValueError(
                f"run.max_staleness: {self.algorithm.name} plans each step's rollouts from "
                "the step before it, so later steps' cannot be generated ahead; use 0"
            )
        if self.training.engine_is == "off":
            raise ValueError(
                f"run.max_staleness: {k} trains on rollouts sampled by weights up to {k} "
                "update(s) old, and with training.engine_is: off nothing corrects for it (the "
                "PPO ratio starts from the trainer's own weights); set training.engine_is: tis "
                "or mask"
            )
        if self.resources.colocate:
            raise ValueError(
                "run.max_staleness: with resources.colocate each engine shares its rank's "
                "device and sleeps while the rank trains, so generation cannot overlap training; "
                "use 0"
            )
        if k >= 2 and self.sync.transport in ("collective", "colocated"):
            raise ValueError(
                f"run.max_staleness: {k} lets the engines load a policy version while the "
                "policy has moved on, from a snapshot the object store holds; "
                f"sync.transport: {self.sync.transport} pushes only the current weights. Use "
                "sync.transport: object_store (or auto)"
            )

    def _check_partial_rollouts(self) -> None:
        """Partial rollouts continue a paused turn from its tokens, with snapshots of two
        versions; refuse what cannot be continued or loaded that way."""
        key = "run.partial_rollout_tokens"
        if not self.run.max_staleness:
            raise ValueError(
                f"{key}: partial rollouts sample a batch with two policy versions while the "
                "policy trains; set run.max_staleness >= 1"
            )
        if self.sync.transport not in ("auto", "object_store"):
            raise ValueError(
                f"{key}: the engines load the newer version from an object-store snapshot; "
                f"sync.transport: {self.sync.transport} cannot hold one (use object_store or auto)"
            )
        if self.generation.stop:
            raise ValueError(
                f"{key}: a stop string could straddle the pause between versions; "
                "generation.stop must be empty"
            )
        if self.generation.engine_loop == "batch":
            raise ValueError(f"{key}: generation.engine_loop: batch cannot pause a request")
        if method_spec(self.algorithm.name).engine_state:
            raise ValueError(
                f"{key}: {self.algorithm.name} keeps per-sample state inside the engine "
                "(a stop rule or an author schedule), which a paused turn would lose; use 0"
            )

    def _check_tensor_parallel(self) -> None:
        r = self.resources
        if r.generator_tp == 1:
            return
        if self.generation.backend != "vllm":
            raise ValueError("resources.generator_tp > 1 needs generation.backend: vllm")
        if method_spec(self.algorithm.name).engine_state:
            # Its per-sample state (stop-rule trackers, the author schedule) lives in the
            # engine's own process and is read by a logits processor there; with TP the
            # processors run in vLLM's worker processes, which cannot see it.
            raise ValueError(
                f"resources.generator_tp > 1 cannot run {self.algorithm.name}: it keeps "
                "per-sample state in the engine's process, which tensor-parallel workers do not "
                "share; use generator_engines for more generation instead"
            )
        if r.generator_gpus and r.generator_gpus != r.generator_tp:
            raise ValueError(
                f"resources.generator_gpus={r.generator_gpus:g} must equal "
                f"resources.generator_tp={r.generator_tp} (one GPU per tensor-parallel worker)"
            )

    @property
    def engine_dtype(self) -> Literal["float32", "bfloat16"]:
        """The rollout engines' weights dtype: generation.dtype, or model.dtype under auto."""
        g = self.generation.dtype
        return self.model.dtype if g == "auto" else g

    def lr_schedule_steps(self) -> tuple[int, int]:
        """(warm-up, total) optimizer steps of the run: run.steps x mini_batches x epochs."""
        t = self.training
        total = self.run.steps * t.mini_batches * t.epochs
        return t.warmup_steps or round(t.warmup_ratio * total), total

    def vllm_on_cpu(self) -> bool:
        """Whether generation runs on vLLM's CPU backend: vLLM engines given no GPU (vLLM then
        finds no CUDA device in the engine's actor)."""
        return vllm_on_cpu(self.generation.backend, self.resources.generator_gpus)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


@functools.cache
def config_model(method: str) -> type[Config]:
    """The training config's model for `method`: `Config` whose `algorithm` section holds the
    method's own section (`algorithm.<method>`), when it brings one."""
    section = method_spec(method).section
    if section is None:
        return Config
    algorithm = create_model(
        f"AlgorithmConfig[{method}]",
        __base__=AlgorithmConfig,
        **{method: (section, Field(default_factory=section, description=section.__doc__))},
    )
    return create_model(
        f"Config[{method}]",
        __base__=Config,
        algorithm=(algorithm, Field(default_factory=algorithm)),
    )


def _method_named(data: dict[str, Any]) -> str:
    """The method a raw config names (grpo when none)."""
    algorithm = data.get("algorithm")
    name = algorithm.get("name", "grpo") if isinstance(algorithm, dict) else "grpo"
    return name if isinstance(name, str) else "grpo"


def _unknown_key(dotted: str, path: list[str]) -> str:
    """The error for an unknown key `dotted` of the override `path`; the old per-method switches
    (`algorithm.<method>.enabled`) and `run.off_policy_steps` say what replaced them."""
    old_switch = path[0] == "algorithm" and path[2:] == ["enabled"]
    if old_switch and path[1] in OLD_METHOD_SWITCHES:
        return _old_switch_error(path[1], "=")
    if path == ["run", "off_policy_steps"]:
        return f"{dotted}: {RENAMED_OFF_POLICY_STEPS}"
    return f"{dotted}: unknown key"


def config_from_dict(data: dict[str, Any]) -> Config:
    """The validated training config of raw data (its method's model, `config_model`)."""
    try:
        model = config_model(_method_named(data))
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path | None = None, overrides: Overrides | None = None) -> Config:
    """Load a YAML file or shipped preset (`"tiny"`; None: the defaults), apply `overrides`
    (`--set` strings or a mapping of dotted keys to values, `Overrides`), validate; ConfigError
    naming the key otherwise."""
    return _configured(read_yaml_sections(path), overrides or [])


def override_config(cfg: Config, overrides: Overrides) -> Config:
    """A new config: `cfg` with `overrides` applied, validated as `load_config` validates."""
    return _configured(cfg.model_dump(), overrides)


def _configured(data: dict[str, Any], overrides: Overrides) -> Config:
    """Raw sections with overrides applied, validated. The method is read first (an override may
    choose it), so that the keys of its own section are known."""
    chosen = {".".join(p): v for p, v in override_items(overrides) if p == ["algorithm", "name"]}
    apply_overrides(data, chosen)
    try:
        known = override_keys(_method_named(data))
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    apply_overrides(data, overrides, known=known, unknown_key=_unknown_key)
    return config_from_dict(data)


def override_keys(method: str) -> dict[str, Any]:
    """The keys an override may set when `method` trains (a `key_tree`): its config's, and every
    other method's section, which a preset may still set. ValueError for an unknown method."""
    known = key_tree(config_model(method))
    for other in method_names():
        section = _section_of(other)
        if section is not None:
            known["algorithm"].setdefault(other, key_tree(section))
    return known
