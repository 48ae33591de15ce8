"""Header-only raw length functions (length_index/header_length.py): a real length index built
with ``energon-ordering index --raw-length-fn`` over a prepared dataset of JPEGs of many sizes
equals the index built by a task encoder that decodes each image with PIL and runs the real
``Qwen2VLImageProcessor`` on it."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from energon_ordering.errors import SampleLengthError
from energon_ordering.length_index import header_length as hl
from energon_ordering.length_index.media_tokens import (
    FixedImageTokens,
    InternVLTokens,
    LlavaNextTokens,
    Qwen2VLTokens,
)

NUM_SAMPLES = 24


def _jpeg(width: int, height: int, seed: int, **options: Any) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "JPEG", quality=80, **options)
    return out.getvalue()


def _samples() -> list[dict[str, Any]]:
    """Captioned JPEGs of random sizes (thin strips and tiny ones too), some progressive."""
    rng = random.Random(33)
    sizes = [(1, 1), (3, 200), (200, 3), (28, 28), (1001, 333)]
    sizes += [(rng.randint(8, 900), rng.randint(8, 900)) for _ in range(NUM_SAMPLES - len(sizes))]
    words = ["ka", "lo", "mi", "nu", "pe"]
    return [{"__key__": f"img-{i:04d}",
             "jpg": _jpeg(w, h, i, progressive=i % 3 == 0),
             "txt": " ".join(rng.choice(words) for _ in range(rng.randint(1, 60))).encode()}
            for i, (w, h) in enumerate(sizes)]


@pytest.fixture(scope="module")
def jpeg_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared CaptioningSample dataset (``energon prepare``) in 3 shards."""
    import webdataset as wds

    from energon_ordering.inspect.synthetic import _energon_prepare

    root = tmp_path_factory.mktemp("jpegs") / "photos"
    root.mkdir()
    with wds.ShardWriter(str(root / "shard-%06d.tar"), maxcount=8, verbose=0) as sink:
        for sample in _samples():
            sink.write(sample)
    _energon_prepare(root, "jpg")
    return root


def _processor_encoder() -> Any:
    """A task encoder that decodes with PIL (as Bridge's and Megatron-LM's do) and counts the
    ``<|image_pad|>`` tokens of the real Qwen2-VL image processor, plus the caption's
    whitespace tokens."""
    import torchvision_cpu_shim

    torchvision_cpu_shim.install()
    pytest.importorskip("transformers")
    from megatron.energon import SampleDecoder, stateless
    from transformers import Qwen2VLImageProcessor

    from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder, LengthSample

    class QwenProcessorLengths(LengthEstimateTaskEncoder):
        decoder = SampleDecoder(image_decode="pil")
        processor = Qwen2VLImageProcessor()

        @stateless
        def encode_sample(self, sample: Any) -> LengthSample:
            grid = self.processor(images=sample.image.convert("RGB"), return_tensors="np",
                                  input_data_format="channels_last")["image_grid_thw"][0]
            media = int(np.prod(grid)) // self.processor.merge_size ** 2
            return LengthSample(__key__=sample.__key__, __restore_key__=sample.__restore_key__,
                                __subflavors__=None, __sources__=None,
                                total_len=media + len(sample.caption.split()),
                                media_tokens=media, source="-")

    return QwenProcessorLengths()


@pytest.mark.slow
def test_header_index_equals_the_processor_index(jpeg_dataset: Path) -> None:
    from energon_ordering.cli import main
    from energon_ordering.length_index.build import build_length_index
    from energon_ordering.length_index.index import LengthIndex

    encoder = _processor_encoder()
    build_length_index(jpeg_dataset, task_encoder=encoder, name="processor")
    result = CliRunner().invoke(main, [
        "index", str(jpeg_dataset), "--name", "header",
        "--raw-length-fn", "energon_ordering.length_index.header_length:qwen2_vl_caption_length"])
    assert result.exit_code == 0, result.output
    by_processor = LengthIndex.open(jpeg_dataset, name="processor")
    by_header = LengthIndex.open(jpeg_dataset, name="header")
    assert "qwen2_vl_caption_length" in by_header.computed_by
    keys = [s["__key__"] for s in _samples()]
    want = {k: by_processor.length(k) for k in keys}
    assert {k: by_header.length(k) for k in keys} == want
    assert len(set(want.values())) > NUM_SAMPLES // 2  # the sizes really give different lengths


@pytest.mark.parametrize("fn, media", [
    (hl.llava_caption_length, FixedImageTokens()),
    (hl.llava_next_caption_length, LlavaNextTokens()),
    (hl.internvl_caption_length, InternVLTokens()),
    (hl.qwen2_vl_caption_length, Qwen2VLTokens()),
])
def test_caption_lengths_count_decoded_sizes_and_caption_words(fn, media) -> None:
    for sample in _samples()[:8]:
        width, height = Image.open(io.BytesIO(sample["jpg"])).convert("RGB").size
        words = len(sample["txt"].decode().split())
        assert fn(sample) == media.image_tokens(width, height) + words


def test_every_image_part_counts_and_others_do_not() -> None:
    png = io.BytesIO()
    Image.new("RGB", (640, 480)).save(png, "PNG")
    raw = {"__key__": "k", "__url__": b"x.jpg", "0.jpg": _jpeg(28, 56, 0), "1.png": png.getvalue(),
           "json": b"{}", "txt": b"a b c"}
    assert hl.raw_image_sizes(raw) == [(28, 56), (640, 480)]
    qwen = Qwen2VLTokens()
    assert hl.qwen2_vl_caption_length(raw) == qwen.image_tokens(28, 56) + qwen.image_tokens(640, 480) + 3


@pytest.mark.parametrize("raw, match", [
    ({"__key__": "k", "jpg": _jpeg(8, 8, 0)}, r"sample 'k' has no part 'txt' \(it has \['jpg'\]\)"),
    ({"__key__": "k", "jpg": _jpeg(8, 8, 0), "txt": b"\xff\xfe"}, r"part 'txt' of sample 'k' is not UTF-8"),
    ({"__key__": "k", "jpg": b"not a jpeg at all", "txt": b"a"}, r"image header: not a JPEG, PNG"),
    ({"__key__": "k", "jpg": _jpeg(8, 8, 0)[:40], "txt": b"a"}, r"image header: JPEG is truncated"),
])
def test_bad_samples_raise_a_typed_error(raw, match: str) -> None:
    with pytest.raises(SampleLengthError, match=match):
        hl.qwen2_vl_caption_length(raw)


@pytest.mark.slow
def test_verify_draws_samples_and_lists_every_mismatch(jpeg_dataset: Path) -> None:
    """``verify_raw_length`` (what ``index --verify N`` runs): 0 mismatches for the exact
    header-only function, every drawn sample listed for a wrong rule (LLaVA-1.5's 576)."""
    from energon_ordering.errors import LengthIndexError
    from energon_ordering.length_index.verify import verify_raw_length

    encoder = _processor_encoder()
    exact = verify_raw_length(jpeg_dataset, raw_length_fn=hl.qwen2_vl_caption_length,
                              task_encoder=encoder, samples=10, seed=1)
    assert (exact.checked, exact.mismatches) == (10, ())
    exact.check(hl.qwen2_vl_caption_length)
    everything = verify_raw_length(jpeg_dataset, raw_length_fn=hl.qwen2_vl_caption_length,
                                   task_encoder=encoder, samples=1000)
    assert (everything.checked, everything.mismatches) == (NUM_SAMPLES, ())
    wrong = verify_raw_length(jpeg_dataset, raw_length_fn=hl.llava_caption_length,
                              task_encoder=encoder, samples=10, seed=1)
    assert wrong.checked == 10 and 8 <= len(wrong.mismatches) <= 10
    again = verify_raw_length(jpeg_dataset, raw_length_fn=hl.llava_caption_length,
                              task_encoder=encoder, samples=10, seed=1)
    assert again == wrong  # the seed fixes the draw
    m = wrong.mismatches[0]
    assert m.raw_length - m.encoded_length == 576 - Qwen2VLTokens().image_tokens(
        *hl.raw_image_sizes(next(s for s in _samples() if s["__key__"] == m.key))[0])
    with pytest.raises(LengthIndexError, match=r"llava_caption_length differs from the task encoder "
                                               r"on \d+ of 10 verified samples: .*photos: sample img-"):
        wrong.check(hl.llava_caption_length)
    with pytest.raises(LengthIndexError, match=r"verify: samples = 0 must be an integer >= 1"):
        verify_raw_length(jpeg_dataset, raw_length_fn=hl.llava_caption_length,
                          task_encoder=encoder, samples=0)


def test_index_verify_lists_mismatches_and_stops_unless_allowed(jpeg_dataset: Path) -> None:
    """``index --raw-length-fn F --verify N``: the task encoder (here the CLI's estimate, which
    counts a fixed number of tokens per image) measures N samples beside F; every mismatch is
    listed and the build stops with exit 2, unless ``--allow-mismatch``."""
    from energon_ordering.cli import main

    fn = "energon_ordering.length_index.header_length:qwen2_vl_caption_length"
    args = ["index", str(jpeg_dataset), "--name", "verified", "--raw-length-fn", fn,
            "--verify", "5"]
    stopped = CliRunner().invoke(main, args)
    assert stopped.exit_code == 2, stopped.output
    assert "differs from the task encoder on 5 of 5 verified samples" in stopped.output
    assert not list(jpeg_dataset.glob(".nv-meta/*verified*"))
    allowed = CliRunner().invoke(main, [*args, "--allow-mismatch"])
    assert allowed.exit_code == 0, allowed.output
    assert "verified 5 samples: 5 mismatch(es)" in allowed.output
    assert list(jpeg_dataset.glob(".nv-meta/*verified*"))  # built now (the pattern finds it)
    refused = CliRunner().invoke(main, ["index", str(jpeg_dataset), "--verify", "3"])
    assert refused.exit_code == 2 and "give --raw-length-fn" in refused.output


def test_verify_reads_only_the_drawn_samples(jpeg_dataset: Path, tmp_path: Path) -> None:
    """``--verify N`` reads its N samples by byte range: a shard none of them lies in is never
    read (zeroed here, it would fail a read in order through it), so the check costs the same
    on 10^8 samples as on 24."""
    import shutil

    from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder
    from energon_ordering.length_index.verify import verify_raw_length

    drawn: list[str] = []

    def recorded(raw: dict) -> int:
        drawn.append(raw["__key__"])
        return hl.llava_caption_length(raw)

    copy = tmp_path / "photos"
    shutil.copytree(jpeg_dataset, copy)
    encoder = LengthEstimateTaskEncoder(tokens_per_media=576)
    for seed in range(200):  # a draw of 2 samples with none in the first shard (keys 0-7)
        drawn.clear()
        verify_raw_length(copy, raw_length_fn=recorded, task_encoder=encoder, samples=2, seed=seed)
        if all(int(key.removeprefix("img-")) >= 8 for key in drawn):
            break
    first = copy / "shard-000000.tar"
    first.write_bytes(bytes(first.stat().st_size))
    before = list(drawn)
    drawn.clear()
    report = verify_raw_length(copy, raw_length_fn=recorded, task_encoder=encoder, samples=2,
                               seed=seed)
    assert drawn == before and report.checked == 2 and report.mismatches == ()


@pytest.mark.slow
def test_header_only_lengths_verify_against_the_local_qwen2_5_vl_processor(
        jpeg_dataset: Path, tmp_path: Path) -> None:
    """``--verify`` against the tests' local Qwen2.5-VL processor (the one Bridge's Qwen encoder
    runs on, tests/bridge_chatml.py: its own tokenizer, chat template and vision settings): the
    header-only rule with those settings plus the template's text tokens gives the processor's
    token count on every sample; the rule's defaults (another max_pixels) do not."""
    import torchvision_cpu_shim

    torchvision_cpu_shim.install()
    pytest.importorskip("transformers")
    import bridge_chatml as bc
    from megatron.energon import SampleDecoder, stateless
    from transformers import AutoProcessor, Qwen2TokenizerFast

    from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder, LengthSample
    from energon_ordering.length_index.verify import verify_raw_length

    processor = AutoProcessor.from_pretrained(str(bc.make_tiny_qwen_processor(
        tmp_path / "p", 0, tokenizer_cls=Qwen2TokenizerFast)))

    def chat(caption: str) -> str:
        return processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": caption}]}])

    class TinyQwenLengths(LengthEstimateTaskEncoder):
        decoder = SampleDecoder(image_decode="pil")

        @stateless
        def encode_sample(self, sample: Any) -> LengthSample:
            ids = processor(text=[chat(sample.caption)], images=[sample.image.convert("RGB")],
                            return_tensors="pt")["input_ids"][0]
            return LengthSample(__key__=sample.__key__, __restore_key__=sample.__restore_key__,
                                __subflavors__=None, __sources__=None, total_len=len(ids),
                                media_tokens=0, source="-")

    def text_tokens(caption: str) -> int:  # the one <|image_pad|> is the processor's to expand
        return len(processor.tokenizer(chat(caption))["input_ids"]) - 1

    tiny = Qwen2VLTokens(patch_size=2, merge_size=bc.MERGE, min_pixels=bc.MIN_PIXELS,
                         max_pixels=bc.MAX_PIXELS)
    exact = verify_raw_length(
        jpeg_dataset, raw_length_fn=lambda raw: hl.header_length(raw, tiny, text_tokens=text_tokens),
        task_encoder=TinyQwenLengths(), samples=NUM_SAMPLES)
    assert (exact.checked, exact.mismatches) == (NUM_SAMPLES, ())
    defaults = verify_raw_length(
        jpeg_dataset,
        raw_length_fn=lambda raw: hl.header_length(raw, Qwen2VLTokens(), text_tokens=text_tokens),
        task_encoder=TinyQwenLengths(), samples=NUM_SAMPLES)
    assert len(defaults.mismatches) > NUM_SAMPLES // 2
