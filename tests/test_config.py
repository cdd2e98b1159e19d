"""Config loading: defaults, overrides, and errors that name the offending key."""

import json
from pathlib import Path

import pytest

from rlvr.config import ConfigError, config_from_dict, load_config, override_config
from rlvr.methods.base import build_method
from rlvr.methods.laconic.config import laconic_dual
from rlvr.models.checks import check_model_dir
from rlvr.run.placement import check_cluster, check_cpus, companions, plan_placement
from rlvr.serving.config import load_serve_config
from rlvr.tasks import load_task

TRAIN_CONFIGS = sorted(
    p for p in (Path(__file__).parent.parent / "configs").glob("*.yaml") if "serve" not in p.name
)


def check_model(cfg, model_dir: Path) -> None:
    """The model-directory check a run (or `rlvr serve`) makes of its config's model."""
    check_model_dir(model_dir, cfg.generation.max_model_len, cfg.vllm_on_cpu())


def test_defaults_validate():
    cfg = load_config()
    assert cfg.generation.group_size == 8
    assert cfg.training.zero_stage == 2
    assert cfg.verifier.max_uncomputed_share == 0.1


@pytest.mark.parametrize("share", ["0", "1", "0.25"])
def test_uncomputed_share_bounds_are_valid(share):
    assert load_config(
        None, [f"verifier.max_uncomputed_share={share}"]
    ).verifier.max_uncomputed_share == float(share)


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_shipped_training_configs_validate(path):
    cfg = load_config(path)
    train, test = load_task(cfg.task)
    assert len(train) == cfg.task.n_train and len(test) == cfg.task.n_test


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  steps: 3\ngeneration:\n  group_size: 4\n")
    cfg = load_config(
        f, ["training.lr=3e-4", "model.lora.enabled=true", "task.difficulty.operators=+-*"]
    )
    assert cfg.run.steps == 3
    assert cfg.generation.group_size == 4
    assert cfg.training.lr == pytest.approx(3e-4)
    assert cfg.model.lora.enabled is True
    assert cfg.task.difficulty.operators == "+-*"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["training.lrr=1"], "training.lrr"),
        (["nosuch.x=1"], "nosuch"),
        (["training.lr=fast"], "training.lr"),
        (["training.lr=-1"], "training.lr"),
        (["generation.group_size=1"], "generation.group_size"),
        (["generation.max_tokens=2048"], "generation"),
        (["training.zero_stage=5"], "training.zero_stage"),
        (["task.difficulty.operators=+/"], "task.difficulty"),
        (['generation.stop=[""]'], "generation"),
        (['task.instruction="{prompt} then {prompt}"'], "task"),
        (["verifier.max_uncomputed_share=1.5"], "verifier.max_uncomputed_share"),
        (["verifier.max_uncomputed_share=-0.1"], "verifier.max_uncomputed_share"),
        (["verifier.max_uncomputed_share=nan"], "verifier.max_uncomputed_share"),
        (["verifier.max_uncomputed_share=half"], "verifier.max_uncomputed_share"),
        (["resources.allocator=tcmalloc"], "resources.allocator"),
        (
            ["resources.allocator=jemalloc", "resources.malloc_mmap_threshold_kib=1024"],
            "resources.malloc_mmap_threshold_kib",
        ),
        (["resources.jemalloc_conf=dirty_decay_ms:0"], "resources.jemalloc_conf"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_off_and_yes_read_as_words_true_and_false_as_booleans(tmp_path):
    """YAML 1.1 would read the 'off' choices as False and fail their validation."""
    path = tmp_path / "c.yaml"
    path.write_text("resources:\n  engine_sleep: off\nmodel:\n  lora:\n    enabled: true\n")
    cfg = load_config(path, ["training.engine_is=off", "run.name=yes"])
    assert cfg.resources.engine_sleep == "off" and cfg.training.engine_is == "off"
    assert cfg.run.name == "yes" and cfg.model.lora.enabled is True
    assert load_config(path, ["model.lora.enabled=false"]).model.lora.enabled is False


def test_unknown_key_in_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("training:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"training\.learning_rate: unknown key"):
        load_config(f)


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    f = tmp_path / "c.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f)


def test_head_size_rejected_for_vllm_on_cpu_only(tmp_path):
    """vLLM's CPU kernels take head sizes 32/64/128 only: refused there, naming model.path;
    the hf backend and vLLM engines on GPUs take the model."""
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 96, "num_attention_heads": 2, "max_position_embeddings": 2048})
    )
    for cfg in (load_config(), load_serve_config()):
        with pytest.raises(ConfigError, match=r"model\.path: head size 48 .* CPU kernels"):
            check_model(cfg, tmp_path)
    check_model(load_config(None, ["generation.backend=hf"]), tmp_path)
    check_model(load_serve_config(None, ["generation.backend=hf"]), tmp_path)
    check_model(load_config(None, ["resources.generator_gpus=1"]), tmp_path)


def test_a_nested_text_config_is_checked_and_a_missing_size_is_left_to_the_engine(tmp_path):
    nested = {"text_config": {"hidden_size": 96, "num_attention_heads": 2}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    with pytest.raises(ConfigError, match=r"model\.path: head size 48"):
        check_model(load_config(), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "custom"}))
    check_model(load_config(), tmp_path)


def test_not_a_model_dir(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        check_model(load_config(), tmp_path)


def test_more_actor_cpus_than_available():
    cfg = load_config(None, ["resources.num_verifiers=4", "resources.verifier_cpus=0.5"])
    with pytest.raises(ConfigError, match=r"resources: the actors need 4 CPUs but 2 are available"):
        check_cpus(cfg, 2)
    check_cpus(load_config(), 2)


@pytest.mark.parametrize(
    ("overrides", "nodes", "message"),
    [
        (["resources.policy_ranks=3"], [{"CPU": 2}], r"need 4 CPUs but 2 .*policy_ranks"),
        (["resources.generator_gpus=1"], [{"CPU": 8}], r"need 1 GPUs but 0 .* generator_gpus"),
        (
            ["resources.policy_resources={rlvr_train: 1}"],
            [{"CPU": 8}],
            r"need 1 rlvr_train but 0 .*policy_resources",
        ),
        (
            ["resources.generator_engines=2", "resources.placement_strategy=STRICT_SPREAD"],
            [{"CPU": 8}, {"CPU": 8}],
            r"STRICT_SPREAD puts each of the 3 model actors .* the cluster has 2",
        ),
        (
            ["resources.placement_strategy=STRICT_PACK"],
            [{"CPU": 1}, {"CPU": 1}],
            r"placement_strategy: STRICT_PACK puts all model actors .* on one node",
        ),
        (
            ["resources.policy_ranks=2", "resources.policy_strategy=STRICT_PACK"],
            [{"CPU": 1.5}, {"CPU": 1.5}],
            r"resources.policy_strategy: STRICT_PACK puts all policy ranks .* no node has "
            r"\{'CPU': 2.0\}",
        ),
        (
            ["resources.generator_engines=3", "resources.generator_strategy=STRICT_SPREAD"],
            [{"CPU": 4}, {"CPU": 4}],
            r"resources.generator_strategy: STRICT_SPREAD puts each of the 3 engines",
        ),
        (
            ["resources.colocate=true", "resources.policy_cpus=2", "resources.generator_cpus=2"],
            [{"CPU": 2}, {"CPU": 2}],
            r"no node has \{'CPU': 4.0\}, the bundle of one of the rank \+ engine pairs",
        ),
    ],
)
def test_layouts_that_cannot_fit_fail_naming_the_keys(overrides, nodes, message):
    with pytest.raises(ConfigError, match=message):
        check_cluster(load_config(None, overrides), nodes)


def test_layouts_that_fit():
    spread = ["resources.policy_ranks=2", "resources.placement_strategy=STRICT_SPREAD"]
    check_cluster(load_config(None, spread), [{"CPU": 1}] * 3)
    roles = [
        "resources.policy_resources={rlvr_train: 1}",
        "resources.generator_resources={rlvr_rollout: 1}",
    ]
    check_cluster(
        load_config(None, roles), [{"CPU": 2, "rlvr_train": 1}, {"CPU": 2, "rlvr_rollout": 1}]
    )


def test_gpu_presets_fit_the_clusters_they_name():
    """The one-node presets fill one 8-GPU node; the two-node preset needs a node per role."""
    configs = Path(__file__).parent.parent / "configs"
    node = {"CPU": 32, "GPU": 8}
    check_cluster(load_config(configs / "smollm2-gpu-node.yaml"), [node])
    colocated = load_config(configs / "smollm2-gpu-colocated.yaml")
    check_cluster(colocated, [node])
    assert plan_placement(colocated.resources).groups[0].bundles[0]["GPU"] == 1.0
    two = load_config(configs / "smollm2-gpu-2nodes.yaml")
    check_cluster(two, [{**node, "rlvr_train": 8}, {**node, "rlvr_rollout": 8}])
    with pytest.raises(ConfigError, match="rlvr_rollout"):
        check_cluster(two, [{"CPU": 64, "GPU": 16, "rlvr_train": 8}])


def test_placement_plans():
    """One group of every model actor, a group per role, or one bundle per colocated pair."""
    one = plan_placement(load_config(None, ["resources.policy_ranks=2"]).resources)
    assert [(g.role, g.strategy, len(g.bundles)) for g in one.groups] == [("models", "PACK", 3)]
    assert (one.policy, one.generator) == (((0, 0), (0, 1)), ((0, 2),))
    per_role = load_config(
        None, ["resources.generator_engines=2", "resources.generator_strategy=SPREAD"]
    )
    plan = plan_placement(per_role.resources)
    assert [(g.role, g.strategy, len(g.bundles)) for g in plan.groups] == [
        ("policy", "PACK", 1),
        ("generator", "SPREAD", 2),
    ]
    assert (plan.policy, plan.generator) == (((0, 0),), ((1, 0), (1, 1)))
    gpus = [f"resources.{k}={v}" for k, v in [("policy_gpus", 0.5), ("generator_gpus", 0.5)]]
    colocated = load_config(
        None,
        ["resources.colocate=true", "resources.policy_ranks=2", "resources.generator_engines=2"]
        + gpus,
    )
    plan = plan_placement(colocated.resources)
    assert plan.groups[0].bundles == ({"CPU": 2.0, "GPU": 1.0},) * 2
    assert plan.policy == plan.generator == ((0, 0), (0, 1))
    assert colocated.resources.engines_sleep
    check_cluster(colocated, [{"CPU": 4, "GPU": 2}])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["resources.policy_ranks=2"], r"policy_ranks \(2\) must equal generator_engines x"),
        (
            ["resources.policy_ranks=2", "resources.generator_tp=2"],
            r"tensor-parallel engine would span the devices of several ranks",
        ),
        (["resources.policy_strategy=PACK"], r"leave resources.policy_strategy and generator_"),
        (["resources.policy_gpus=1"], r"policy_gpus and generator_gpus must both be > 0"),
        (
            ["resources.policy_gpus=1", "resources.generator_gpus=0.5"],
            r"policy_gpus \+ generator_gpus = 1.5 asks for more than the one device",
        ),
    ],
)
def test_impossible_colocations_fail_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["resources.colocate=true", *overrides])


def test_colocated_transport_needs_colocation():
    with pytest.raises(ConfigError, match=r"sync.transport: colocated .* resources.colocate"):
        load_config(None, ["sync.transport=colocated"])
    cpu = load_config(None, ["resources.colocate=true", "sync.transport=colocated"])
    assert not cpu.resources.engines_sleep  # vLLM's sleep mode needs a GPU


def test_colocated_gpus_cannot_sync_over_nccl():
    colocated = ["resources.colocate=true", "sync.transport=collective"]
    load_config(None, colocated)  # gloo on CPU takes two ranks of one process group on a host
    gpus = ["resources.policy_gpus=0.5", "resources.generator_gpus=0.5"]
    with pytest.raises(ConfigError, match=r"sync.transport: collective .* NCCL refuses two ranks"):
        load_config(None, [*colocated, *gpus])
    assert load_config(None, [*colocated[:1], *gpus]).sync.transport == "auto"


def test_laconic_defaults_and_dual_kwargs():
    cfg = load_config(None, ["algorithm.name=laconic", "algorithm.laconic.budget=64"])
    lc = cfg.algorithm.laconic
    assert (lc.eta, lc.lam_max, lc.lam_init, lc.cost) == (0.002, 0.3, 0.0, "hinge")
    assert laconic_dual(cfg) == {"budget": 64, "eta": 0.002, "lam_max": 0.3, "lam": 0.0}
    assert build_method(load_config(None, [])).controller_state() is None


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algorithm.name=laconic"], "algorithm.laconic"),
        (
            ["algorithm.name=laconic", "algorithm.laconic.budget=256"],
            "algorithm.laconic.budget",
        ),
        (["algorithm.name=laconic", "algorithm.laconic.budget=0"], "algorithm.laconic.budget"),
        (["algorithm.name=laconic", "algorithm.laconic.lam_max=-1"], "algorithm.laconic"),
        (["algorithm.name=laconic", "algorithm.laconic.cost=square"], "algorithm.laconic.cost"),
    ],
)
def test_laconic_bad_values_name_the_key(overrides, key):
    # generation.max_tokens defaults to 256: a budget of 256 can never bind
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_laconic_warns_above_the_safe_ceiling_and_auto_resolves_to_it():
    on = ["algorithm.name=laconic", "algorithm.laconic.budget=200"]
    with pytest.warns(UserWarning, match="safe ceiling"):  # 200 / (256 - 200) = 3.57 is safe...
        load_config(None, [*on, "algorithm.laconic.lam_max=5"])  # ...but 5 is not
    cfg = load_config(None, [*on, "algorithm.laconic.lam_max=auto"])
    assert laconic_dual(cfg)["lam_max"] == pytest.approx(200 / 56)


def test_tensor_parallel_engines_refuse_in_engine_state():
    load_config("configs/tiny.yaml", ["resources.generator_tp=2"])
    for preset in ("configs/tiny-duet.yaml", "configs/tiny-tandem.yaml"):
        with pytest.raises(ConfigError, match="generator_tp > 1 cannot run (duet|tandem)"):
            load_config(preset, ["resources.generator_tp=2"])
    with pytest.raises(ConfigError, match="generator_gpus=1 must equal resources.generator_tp=2"):
        load_config(None, ["resources.generator_tp=2", "resources.generator_gpus=1"])


@pytest.mark.parametrize(
    ("section", "method"),
    [
        ("laconic", "laconic"),
        ("duet", "duet"),
        ("dro", "dro"),
        ("tandem", "tandem"),
        ("dynamic_sampling", "dapo"),
    ],
)
def test_the_old_method_switches_say_what_replaced_them(section, method):
    hint = rf"algorithm\.{section}\.enabled: methods are chosen by algorithm\.name; "
    with pytest.raises(ConfigError, match=hint + rf"write algorithm\.name={method}"):
        load_config(None, [f"algorithm.{section}.enabled=true"])
    with pytest.raises(ConfigError, match=hint + rf"write algorithm\.name: {method}"):
        config_from_dict({"algorithm": {section: {"enabled": True}}})


def test_the_method_is_picked_by_name():
    assert load_config(None, []).algorithm.name == "grpo"
    for name in ("laconic", "duet", "dro", "tandem", "dapo"):
        sets = {"laconic": ["algorithm.laconic.budget=64"], "duet": ["generation.max_tokens=512"]}
        assert (
            load_config(None, [f"algorithm.name={name}", *sets.get(name, [])]).algorithm.name
            == name
        )
    with pytest.raises(ConfigError, match=r"algorithm\.name: unknown method 'ppo'; choose one of"):
        load_config(None, ["algorithm.name=ppo"])


def test_sampling_params_carry_the_stop_strings_to_every_pass():
    g = load_config(None, ['generation.stop=["\\nQuestion:"]', "generation.temperature=0.9"])
    g = g.generation
    rollout = g.sampling_params(7)
    assert (rollout.temperature, rollout.top_p, rollout.seed) == (0.9, 1.0, 7)
    assert rollout.stop == ("\nQuestion:",) and rollout.max_tokens == g.max_tokens
    greedy = g.sampling_params(None, temperature=0.0, top_p=1.0)
    assert (greedy.temperature, greedy.stop) == (0.0, ("\nQuestion:",))


def test_task_fields_map_our_names_and_unknown_ones_fail_naming_the_key(tmp_path):
    file_sets = ["task.name=file", "task.train_path=data.jsonl"]
    cfg = load_config(None, [*file_sets, "task.fields.prompt=question", "task.fields.id=key"])
    assert cfg.task.fields.mapping() == {"prompt": "question", "id": "key"}
    assert "fields" in cfg.task.cache_key()
    assert "fields" not in load_config().task.cache_key()  # cache keys made before fields match
    with pytest.raises(ConfigError, match=r"task\.fields\.question: unknown key"):
        load_config(None, [*file_sets, "task.fields.question=prompt"])
    f = tmp_path / "c.yaml"
    f.write_text("task:\n  name: file\n  train_path: d.jsonl\n  fields:\n    question: q\n")
    with pytest.raises(ConfigError, match=r"task\.fields\.question: unknown key"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"task\.fields: map either answer or tests"):
        load_config(None, [*file_sets, "task.fields.tests=t", "task.fields.answer=a"])
    with pytest.raises(ConfigError, match=r"task: fields apply to dataset files"):
        load_config(None, ["task.fields.prompt=question"])


def _gsm8k_file(path, n=10):
    """GSM8K's published rows: question, and answer ending in '#### <gold>'; no id."""
    rows = [
        {
            "question": f"Ann has {i} pens and buys 2. How many?",
            "answer": f"She has {i} + 2 = <<{i}+2={i + 2}>>{i + 2} pens.\n#### {i + 2}",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_gsm8k_file_passes_the_training_config_path_without_ray(tmp_path, monkeypatch):
    import ray

    from workflows.train import prepare

    def no_ray(*args, **kwargs):
        raise AssertionError("the config path started Ray")

    monkeypatch.setattr(ray, "init", no_ray)

    f = _gsm8k_file(tmp_path / "gsm8k.jsonl")
    sets = ["task.name=file", f"task.train_path={f}", "generation.backend=hf"]
    _, train, test = prepare(load_config(None, sets))
    assert (len(train), len(test)) == (8, 2)  # the last fifth held out
    assert train[0].prompt == "Ann has 0 pens and buys 2. How many?" and train[0].answer == "2"
    assert train[0].solution == "She has 0 + 2 = 2 pens.\nThe answer is \\boxed{2}."
    assert all(len(p.id) == 12 for p in train + test)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}))
    with pytest.raises(
        ConfigError,
        match=r"invalid config: task: .*chat\.jsonl: row 1: field 'prompt' is a list of chat "
        r"messages, which task\.chat_template=false cannot render",
    ):
        prepare(
            load_config(
                None, ["task.name=file", f"task.train_path={chat}", "task.chat_template=false"]
            )
        )


BOXED = "rlvr.verifiers.rewards:boxed_format"
TWO_REWARDS = (
    f"verifier.rewards=[{{kind: math}}, {{kind: python, function: '{BOXED}', weight: 0.2}}]"
)


def test_reward_plugins_and_weighted_rewards_validate():
    cfg = load_config(None, ["verifier.kind=python", f"verifier.function={BOXED}"])
    assert cfg.verifier.verifier_kwargs() == {
        "kind": "python",
        "function": BOXED,
        "rewards": [],
        "unsafe_hook_sandbox": False,
    }
    cfg = load_config(None, [TWO_REWARDS])
    assert config_from_dict(cfg.to_dict()) == cfg  # the saved config a resume reloads
    assert cfg.verifier.kinds() == {"math", "python"}
    assert [(r["kind"], r["weight"]) for r in cfg.verifier.verifier_kwargs()["rewards"]] == [
        ("math", 1.0),
        ("python", 0.2),
    ]
    # the default, kind alone, is unchanged
    assert load_config().verifier.verifier_kwargs() == {
        "kind": "math",
        "function": None,
        "rewards": [],
        "unsafe_hook_sandbox": False,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["verifier.kind=python"], "verifier.function: kind 'python' needs a function"),
        (
            ["verifier.kind=python", "verifier.function=no_such_package.rewards:fn"],
            "verifier.function: cannot import 'no_such_package.rewards:fn': ModuleNotFoundError",
        ),
        (
            ["verifier.kind=python", "verifier.function=rlvr.verifiers.rewards:nope"],
            "verifier.function: cannot import .*AttributeError",
        ),
        (
            ["verifier.kind=python", "verifier.function=rlvr.verifiers.rewards"],
            "verifier.function: cannot import .*not of the form 'package.module:name'",
        ),
        (
            ["verifier.kind=python", "verifier.function=rlvr.verifiers.rewards:BOXED_AT_END"],
            "verifier.function: .* is not callable",
        ),
        ([f"verifier.function={BOXED}"], "verifier.function: only kind 'python' takes"),
        (["verifier.rewards=[{kind: math}, {kind: python}]"], "verifier.rewards.1.function"),
        (["verifier.rewards=[{kind: math}, {kind: code, weight: x}]"], "verifier.rewards.1.weight"),
        (["verifier.rewards=[{kind: math, weight: .nan}]"], "verifier.rewards.0.weight: must be"),
        (["verifier.rewards=[{kind: math}, {kind: math}]"], "verifier.rewards.1.name: 'math'"),
        (["verifier.rewards=[{kind: maths}]"], "verifier.rewards.0.kind"),
        ([TWO_REWARDS, "verifier.kind=code"], "verifier.rewards: set either"),
        ([TWO_REWARDS, f"verifier.function={BOXED}"], "verifier.rewards: set either"),
        (
            ["task.name=code", TWO_REWARDS],
            "verifier.kind: task 'code' has assert tests for golds",
        ),
    ],
)
def test_bad_reward_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=f"invalid config: {message}"):
        load_config(None, overrides)


def _answer_is_gold(prompts, responses, golds, metadata):
    return [float(r.strip() == g) for r, g in zip(responses, golds, strict=True)]


def test_python_overrides_take_values_as_they_are_and_a_reward_function_itself():
    cfg = load_config(
        "tiny",
        {
            "run.steps": 3,
            "run.name": "off",  # a string stays a string (as YAML it would be False)
            "verifier.kind": "python",
            "verifier.function": _answer_is_gold,
        },
    )
    assert cfg.run.steps == 3 and cfg.run.name == "off"
    assert cfg.verifier.function is _answer_is_gold
    assert cfg.verifier.verifier_kwargs()["function"] is _answer_is_gold  # to the actors as is
    # the saved config names it where it was defined
    assert cfg.to_dict()["verifier"]["function"] == f"{__name__}:_answer_is_gold"
    weighted = load_config(
        None,
        {"verifier.rewards": [{"kind": "math"}, {"kind": "python", "function": _answer_is_gold}]},
    )
    assert weighted.to_dict()["verifier"]["rewards"][1]["function"].endswith(":_answer_is_gold")


def test_python_overrides_fail_as_the_command_line_s_do():
    for overrides in ({"run.nope": 1}, ["run.nope=1"]):
        with pytest.raises(ConfigError, match=r"^invalid config: run.nope: unknown key$"):
            load_config("tiny", overrides)
    with pytest.raises(ConfigError, match="run.steps: Input should be greater than 0"):
        load_config("tiny", {"run.steps": 0})
    with pytest.raises(ConfigError, match="is one string"):
        load_config("tiny", "run.steps=3")
    with pytest.raises(ConfigError, match="dotted key"):
        load_config("tiny", {"run.": 3})
    with pytest.raises(
        ConfigError, match="verifier.function: 3 is neither .package.module:name. nor callable"
    ):
        load_config(None, {"verifier.kind": "python", "verifier.function": 3})


def test_overrides_apply_to_a_config_object_as_a_new_one():
    cfg = load_config("tiny")
    laconic = override_config(cfg, {"algorithm.name": "laconic", "algorithm.laconic.budget": 30})
    assert laconic.algorithm.laconic.budget == 30 and cfg.algorithm.name == "grpo"
    assert laconic.run == cfg.run and laconic is not cfg
    with pytest.raises(ConfigError, match="algorithm.laconic.budget"):
        override_config(cfg, {"algorithm.laconic.budget": -1})


SEPARATE = ["algorithm.name=tandem", "algorithm.tandem.junior=separate"]


def test_a_separate_tandem_junior_is_refused_only_where_it_cannot_run():
    assert load_config(None, ["algorithm.name=tandem"]).algorithm.tandem.junior == "shared"
    for backend in ("vllm", "hf"):
        load_config(None, [*SEPARATE, f"generation.backend={backend}"])
    load_config(None, [*SEPARATE, "run.max_staleness=1", "training.engine_is=tis"])
    with pytest.raises(
        ConfigError, match=r"algorithm\.tandem\.junior: separate cannot run here: .*colocate"
    ):
        load_config(None, [*SEPARATE, "resources.colocate=true"])
    with pytest.raises(ConfigError, match=r"algorithm\.tandem\.junior: Input should be"):
        load_config(None, ["algorithm.name=tandem", "algorithm.tandem.junior=both"])


def test_separate_junior_engines_are_placed_beside_the_engines():
    """A junior engine per engine, with an engine's bundle, in the engines' group, after them."""
    cfg = load_config(None, [*SEPARATE, "resources.generator_engines=2"])
    plan = plan_placement(cfg.resources, companions(cfg))
    assert [(g.role, len(g.bundles)) for g in plan.groups] == [("models", 5)]
    assert (plan.generator, plan.companion) == (((0, 1), (0, 2)), ((0, 3), (0, 4)))
    per_role = load_config(
        None, [*SEPARATE, "resources.generator_engines=2", "resources.generator_strategy=SPREAD"]
    )
    plan = plan_placement(per_role.resources, companions(per_role))
    assert plan.companion == ((1, 2), (1, 3)) and len(plan.groups[1].bundles) == 4
    assert companions(load_config(None, ["algorithm.name=tandem"])) == 0
    # 1 policy + 2 engines + 2 juniors = 5 CPUs (1 each; the verifiers reserve none by default)
    check_cpus(cfg, 5)
    with pytest.raises(ConfigError, match=r"need 5 CPUs \(with 2 junior engines\)"):
        check_cpus(cfg, 4)
