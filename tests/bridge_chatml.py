"""Offline inputs for Bridge's built-in VLM encoders: a prepared ChatML + image Energon dataset
and a tiny local Qwen2.5-VL processor (a WordLevel tokenizer, no network, no weights).

The dataset is what Bridge's ``ChatMLWebdataset`` reads (``megatron/bridge/data/energon/
task_encoder_utils.py``): ``conversation`` from a JSON part in ShareGPT form with an ``<image>``
placeholder, ``imgs`` from a pickled list of encoded images (its ``videohandler``, ``jpgs``),
indexed by Bridge's own ``prepare_webdataset`` (Energon's preparation API). Sample ``i``'s user
turn holds the token ``k<i>``, so a collated row names the sample it came from.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import numpy as np

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>", "<|endoftext|>"]
WORDS = ["system", "user", "assistant", "describe", "the", "image", "<image>"] + [f"w{i}" for i in range(32)]
#: A Qwen-style ChatML template over structured content (image parts become the vision span).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Vision settings of the tiny processor: 2-pixel patches merged 2 x 2, at most 32 x 32 pixels.
MIN_PIXELS, MAX_PIXELS, MERGE = 64, 1024, 2


def make_tiny_qwen_processor(out: Path, num_samples: int,
                             tokenizer_cls: type | None = None) -> Path:
    """Saves a ``Qwen2_5_VLProcessor`` (Bridge's registry maps it to its Qwen collate) with a
    WordLevel tokenizer knowing ``k0 .. k<num_samples-1>``; returns its folder.
    ``tokenizer_cls``: the tokenizer's class (default ``PreTrainedTokenizerFast``; transformers
    4.57 on Python 3.11 asks for ``Qwen2TokenizerFast``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    words = SPECIAL + WORDS + [f"k{i}" for i in range(num_samples)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = (tokenizer_cls or PreTrainedTokenizerFast)(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL[2:])
    vision = dict(patch_size=2, temporal_patch_size=2, merge_size=MERGE)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        video_processor=Qwen2VLVideoProcessor(**vision),
        tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
    )
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(out))
    return out


def _png(index: int, width: int, height: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(index)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def make_chatml_dataset(out: Path, num_samples: int, *, shard_size: int = 16) -> Path:
    """Writes and prepares ``num_samples`` one-image ChatML samples with answers of 1 to 40
    words and images of varied aspect; returns the dataset folder."""
    import webdataset as wds
    from megatron.bridge.data.energon.prepare import prepare_webdataset

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=shard_size, verbose=0) as sink:
        for i in range(num_samples):
            answer = " ".join(f"w{j}" for j in rng.integers(0, 32, size=int(rng.integers(1, 41))))
            conversation = {"conversations": [
                {"from": "human", "value": f"<image> describe the image k{i}"},
                {"from": "gpt", "value": answer},
            ]}
            width, height = (int(v) for v in rng.choice([8, 16, 24, 32], size=2))
            sink.write({"__key__": f"chat-{i:05d}", "json": json.dumps(conversation),
                        "jpgs": pickle.dumps([_png(i, width, height)])})
    prepare_webdataset(out, {"train": ".*"}, num_workers=1)
    (out / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.bridge.data.energon.task_encoder_utils\n"
        "__class__: ChatMLWebdataset\n"
        "field_map:\n  imgs: jpgs\n  conversation: json\n"
    )
    return out


def sample_ids(input_ids, tokenizer) -> list[int]:
    """The ``k<i>`` sample number in each row of a collated ``input_ids`` (one per row; in
    in-batch packed rows, every one in order)."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[w]: int(w[1:]) for w in vocab if w.startswith("k") and w[1:].isdigit()}
    return [ids[t] for t in input_ids.flatten().tolist() if t in ids]
