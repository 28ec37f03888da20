"""The zoo's families and their one-process cases (``benchmarks/zoo.py``).

A *family* is a transformers model type whose config class ships a ``base_model_tp_plan``,
or a diffusers model class with a ``_tp_plan``. ``build_case`` runs in the parent, in one
process: it builds the tiny model, perturbs every floating-point tensor (so that a bias added
twice or a wrong shard cannot hide behind zero or constant initial values), saves it with
``save_pretrained`` into several files, and records the reference output of a fixed input.
The ranks then only load and compare.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from _zoo_configs import tiny_config

SEQ = 12
BATCH = 2
SHARD_BYTES = 40_000  # several safetensors files for every tiny model

# Preferred heads, most specific first; the first class of the family that exists is used.
_HEADS = ("ForCausalLM", "ForConditionalGeneration", "ForMaskedLM", "LMHeadModel")


@dataclass
class Family:
    """One row of the sweep. ``model_class`` is ``module:Name``."""

    name: str
    library: str  # "transformers" | "diffusers"
    model_class: str = ""
    config_class: str = ""
    skip: str = ""  # why it cannot be tested at all (no text model class, ...)
    ep_plan: bool = False  # its config class has a base_model_ep_plan: the peer also loads at ep_size = tp


@dataclass
class Case:
    """What the parent built for one family; the ranks read it from ``case.json``."""

    family: str
    library: str
    model_class: str
    folder: str
    moe: bool = False
    ep_plan: bool = False  # as its Family's
    hub_layout: bool = False
    files: int = 0
    output: str = ""       # "logits" | "last_hidden_state" | "sample"
    error: str = ""        # build or one-process forward failure
    stage: str = ""        # "build" | "forward" when error is set
    key_diff: list = field(default_factory=list)


def _qualname(obj) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def import_name(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def transformers_families() -> list[Family]:
    """Every model type whose config class declares a ``base_model_tp_plan``, with the class
    the sweep builds: a text-LM head class of the family, else its base model."""
    from transformers.models.auto import modeling_auto as auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    out = []
    for model_type in CONFIG_MAPPING_NAMES:
        config_class = CONFIG_MAPPING[model_type]
        if not getattr(config_class, "base_model_tp_plan", None):
            continue
        fam = Family(model_type, "transformers", config_class=_qualname(config_class),
                     ep_plan=bool(getattr(config_class, "base_model_ep_plan", None)))
        cls = _model_class(model_type, config_class, auto)
        if cls is None:
            fam.skip = "no model class for this config in transformers"
        elif "input_ids" not in inspect.signature(cls.forward).parameters:
            fam.skip = f"{cls.__name__}.forward takes no input_ids (a vision/audio part)"
        else:
            fam.model_class = _qualname(cls)
        out.append(fam)
    return out


# The text encoders of diffusers pipelines whose config class ships no base_model_tp_plan: T5 and
# UMT5 encoders (shardwise's plans: shardwise/hf/encoder_plans.py) and the composite Mistral3
# (Flux.2's) and Qwen2.5-VL (QwenImage's), whose text model's plan applies under their prefix.
# family -> (model class, config class) in transformers
TEXT_ENCODERS = {"t5_encoder": ("T5EncoderModel", "T5Config"),
                 "umt5_encoder": ("UMT5EncoderModel", "UMT5Config"),
                 "mistral3": ("Mistral3ForConditionalGeneration", "Mistral3Config"),
                 "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig")}


def text_encoder_families() -> list[Family]:
    """:data:`TEXT_ENCODERS` as families (a class transformers lacks: skipped, saying so)."""
    import transformers

    out = []
    for name, (model, config) in TEXT_ENCODERS.items():
        cls, config_cls = getattr(transformers, model, None), getattr(transformers, config, None)
        fam = Family(name, "transformers")
        if cls is None or config_cls is None:
            fam.skip = f"transformers {transformers.__version__} has no {model}"
        else:
            fam.model_class, fam.config_class = _qualname(cls), _qualname(config_cls)
        out.append(fam)
    return out


def ep_plan_families() -> set[str]:
    """The model types whose config class also declares a ``base_model_ep_plan`` (transformers
    5.25 moved the experts of its MoE families there)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    return {t for t in CONFIG_MAPPING_NAMES if getattr(CONFIG_MAPPING[t], "base_model_ep_plan", None)}


def _model_class(model_type, config_class, auto):
    """The family's LM-head class taking the config itself, else its base model class."""
    module_name = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except Exception:
        module = None
    candidates = []
    if module is not None:
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == module_name and getattr(obj, "config_class", None) is config_class:
                candidates.append(obj)
    registered = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if registered:
        cls = _find_class(registered)
        if cls is not None and getattr(cls, "config_class", None) is config_class:
            return cls
    for suffix in _HEADS:
        for cls in candidates:
            if cls.__name__.endswith(suffix):
                return cls
    base = auto.MODEL_MAPPING_NAMES.get(model_type)
    if base:
        cls = _find_class(base)
        if cls is not None and getattr(cls, "config_class", None) is config_class:
            return cls
    for cls in candidates:
        if cls.__name__.endswith("Model") and not cls.__name__.endswith("PreTrainedModel"):
            return cls
    if not candidates:  # a config served by another family's classes (exaone -> Llama)
        for name in (registered, base):
            cls = _find_class(name) if name else None
            if cls is not None:
                return cls
    return None


def _find_class(name: str):
    import transformers

    try:
        return getattr(transformers, name)
    except Exception:
        return None


def diffusers_families() -> list[Family]:
    """Every diffusers model class exported at top level with a non-empty ``_tp_plan``."""
    import diffusers
    from _zoo_diffusers import DIFFUSERS_CASES

    out = []
    for name in sorted(dir(diffusers)):
        try:
            obj = getattr(diffusers, name)
        except Exception:
            continue
        if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and getattr(obj, "_tp_plan", None):
            fam = Family(name, "diffusers", model_class=_qualname(obj))
            if name not in DIFFUSERS_CASES:
                fam.skip = "no tiny config and input written for this class in benchmarks/_zoo_diffusers.py"
            out.append(fam)
    return out


def text_inputs(vocab: int) -> dict:
    """The fixed input of every transformers case."""
    gen = torch.Generator().manual_seed(1234)
    return {"input_ids": torch.randint(4, vocab, (BATCH, SEQ), generator=gen)}


def perturb_(model: torch.nn.Module, seed: int = 0) -> None:
    """Add small noise to every floating tensor (parameters and persistent buffers), so that
    zero biases and constant norms cannot mask a sharding fault."""
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():  # state_dict: parameters and persistent buffers, ties once
        for t in model.state_dict(keep_vars=True).values():
            if t.is_floating_point() and t.numel() and id(t) not in seen and t.device.type != "meta":
                seen.add(id(t))
                t.add_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.02)


def pick_output(out, library: str):
    """The tensor compared across tools: logits, else the last hidden state, else ``sample``."""
    for name in ("logits", "last_hidden_state", "sample"):
        value = getattr(out, name, None)
        if value is None and isinstance(out, dict):
            value = out.get(name)
        if value is not None:
            return name, value
    if isinstance(out, tuple | list) and out and torch.is_tensor(out[0]):
        return "output[0]", out[0]
    if torch.is_tensor(out):
        return "output", out
    raise TypeError(f"cannot find logits/last_hidden_state in {type(out).__name__}")


def run_forward(model, library: str, inputs: dict):
    with torch.no_grad():
        out = model(**inputs) if library == "transformers" else model(**inputs, return_dict=True)
    return pick_output(out, library)


def build_case(fam: Family, root: Path, tp: int) -> Case:
    """Build, save and run ``fam`` in this process; write ``case.json`` and ``reference.pt``."""
    folder = root / fam.name
    folder.mkdir(parents=True, exist_ok=True)
    case = Case(fam.name, fam.library, fam.model_class, str(folder), ep_plan=fam.ep_plan)
    try:
        model, inputs = _build(fam, tp)
        case.moe = _model_is_moe(model)
        model.save_pretrained(folder, max_shard_size=SHARD_BYTES)
        case.files = len(list(folder.glob("*.safetensors")))
        case.key_diff = _key_diff(model, folder)
        case.hub_layout = bool(case.key_diff)
    except Exception as e:  # noqa: BLE001 - every failure is a row of the report
        case.error, case.stage = first_line(e), "build"
        _write(case, folder)
        return case
    try:
        name, ref = run_forward(model, fam.library, inputs)
        case.output = name
        torch.save({"inputs": inputs, "reference": ref.detach().clone()}, folder / "reference.pt")
    except Exception as e:  # noqa: BLE001
        case.error, case.stage = first_line(e), "forward"
        _write(case, folder)
        return case
    del model
    try:
        _check_round_trip(fam, folder, inputs, ref)
    except Exception as e:  # noqa: BLE001
        case.error, case.stage = first_line(e), "round trip"
    _write(case, folder)
    return case


def _check_round_trip(fam: Family, folder: Path, inputs: dict, ref: torch.Tensor) -> None:
    """One process, no tensor parallelism: the library's own ``from_pretrained`` of the saved
    folder must give the reference, or a difference on the ranks would prove nothing."""
    cls = import_name(fam.model_class)
    kwargs = {"dtype": torch.float32} if fam.library == "transformers" else {}
    _, out = run_forward(cls.from_pretrained(folder, **kwargs).eval(), fam.library, inputs)
    if out.shape != ref.shape or not torch.allclose(out, ref, rtol=1e-5, atol=1e-5):
        diff = (out - ref).abs().max().item() if out.shape == ref.shape else "shape"
        raise AssertionError(f"one-process from_pretrained of the saved checkpoint differs from the model "
                             f"that saved it (max |diff| {diff})")


def _build(fam: Family, tp: int):
    cls = import_name(fam.model_class)
    torch.manual_seed(0)
    if fam.library == "diffusers":
        from _zoo_diffusers import DIFFUSERS_CASES

        make_config, make_inputs = DIFFUSERS_CASES[fam.name]
        model = cls(**make_config(tp))
        inputs = make_inputs(model.config)
    else:
        config = tiny_config(import_name(fam.config_class), tp, fam.name)
        model = cls(config)
        inputs = text_inputs(_vocab(config))
    model.eval()
    perturb_(model)
    return model, inputs


def _vocab(config) -> int:
    vocab = getattr(config, "vocab_size", None)
    text = getattr(config, "text_config", None)
    if vocab is None and text is not None:
        vocab = getattr(text, "vocab_size", None)
    return min(vocab or 256, 256)


def _model_is_moe(model) -> bool:
    """Mixture of experts by structure: a config may carry expert counts it does not use
    (Doge, Gemma 4 without ``enable_moe``), and expert modules go by many names."""
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return any("expert" in n.lower() or "moe" in n.lower() for n in names)


def saved_keys(folder: Path) -> set[str]:
    """Tensor names in the checkpoint ``save_pretrained`` wrote (index or single file)."""
    from safetensors import safe_open

    index = list(folder.glob("*.safetensors.index.json"))
    if index:
        return set(json.loads(index[0].read_text())["weight_map"])
    keys: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            keys.update(fh.keys())
    return keys


def _key_diff(model, folder: Path) -> list[str]:
    """A few keys that are in the checkpoint but not the module, or the reverse."""
    state = model.state_dict(keep_vars=True)
    disk = saved_keys(folder)
    extra = sorted(disk - set(state))
    saved_ids = {id(state[k]) for k in disk if k in state}
    # A tied alias (lm_head.weight = embed_tokens.weight) is saved once: not a layout change.
    lacking = sorted(k for k in set(state) - disk if id(state[k]) not in saved_ids)
    return [f"+{k}" for k in extra[:3]] + [f"-{k}" for k in lacking[:3]] if extra or lacking else []


def first_line(e: BaseException, limit: int = 160) -> str:
    """``Type: first line``; for a bare ``assert`` (no message), where it was raised."""
    import traceback

    text = str(e).strip().splitlines()
    if text:
        msg = f"{type(e).__name__}: {text[0]}"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        msg = f"{type(e).__name__} (no message) at {where}"
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _write(case: Case, folder: Path) -> None:
    (folder / "case.json").write_text(json.dumps(asdict(case), indent=1))


def read_case(folder: Path) -> Case:
    return Case(**json.loads((folder / "case.json").read_text()))
