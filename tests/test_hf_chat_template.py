"""Issue 29 item 5: a checkpoint's own chat template. Every family's preprocessor tokenizes with the
template a checkpoint ships (its processor's, its tokenizer's or a legacy ``chat_template.json``),
the token ids equal what rendering, expanding the media markers in the text (as the processors do)
and tokenizing give, the labels are exactly the assistant turns, and the shape policy's counts equal
the dataset's tensors; the LLaVA-v1 / ChatML fallback keeps its policy identity, so a cost model
profiled before is still accepted there and refused, naming both policies, under a template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from test_costmodel import synthetic_profile  # noqa: E402

from dflop_ds.cost import FittedCostModel, check_policy  # noqa: E402
from dflop_ds.data import read_dataset  # noqa: E402
from dflop_ds.models.hf.base.dataset import MediaDataset, load_llava_records
from dflop_ds.models.hf.internvl.data import InternVLDataset, InternVLPreprocessor  # noqa: E402
from dflop_ds.models.hf.llava.data import LlavaPreprocessor
from dflop_ds.models.hf.llava_onevision.data import OnevisionDataset, OnevisionPreprocessor  # noqa: E402
from dflop_ds.models.hf.qwen2_vl.data import Qwen2VLDataset, Qwen2VLPreprocessor  # noqa: E402
from dflop_ds.testing.hf_tiny import build_tiny_llava  # noqa: E402
from dflop_ds.testing.internvl_tiny import build_tiny_internvl  # noqa: E402
from dflop_ds.testing.llava_data import write_llava_dataset  # noqa: E402
from dflop_ds.testing.llava_onevision_tiny import build_tiny_llava_onevision  # noqa: E402
from dflop_ds.testing.qwen2_vl_tiny import build_tiny_qwen2_vl  # noqa: E402
from dflop_ds.testing.video import add_video_records  # noqa: E402

END = "</s>"


def chat_template(image: str, video: str, *, images_first: bool = False) -> str:
    """A template unlike the built-in ones: ``[role]`` headers, a default system message, ``</s>``
    after every turn, ``image`` / ``video`` for the media (all of a turn's images first when
    ``images_first``, as LLaVA-OneVision's template writes them)."""
    media = f"{{% if c['type'] == 'image' %}}{image}{{% elif c['type'] == 'video' %}}{video}"
    if images_first:
        body = (
            f"{{% for c in m['content'] if c['type'] == 'image' %}}{image}{{% endfor %}}"
            f"{{% for c in m['content'] if c['type'] != 'image' %}}{media}"
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
        )
    else:
        body = f"{{% for c in m['content'] %}}{media}{{% else %}}{{{{ c['text'] }}}}{{% endif %}}{{% endfor %}}"
    return (
        "{% if messages[0]['role'] != 'system' %}[system]\nBe brief." + END + "\n{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}]\n" + body + END + "\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]\n{% endif %}"
    )


#: family -> (builder, preprocessor, dataset, image marker, image block text of n tokens, takes videos)
FAMILIES = {
    "llava": (build_tiny_llava, LlavaPreprocessor, MediaDataset, "<image>", lambda n: "<image>" * n, False),
    "qwen2_vl": (
        lambda d: build_tiny_qwen2_vl(d, max_pixels=48 * 48),
        Qwen2VLPreprocessor,
        Qwen2VLDataset,
        "<|image_pad|>",
        lambda n: "<|image_pad|>" * n,
        True,
    ),
    "llava_onevision": (
        build_tiny_llava_onevision,
        OnevisionPreprocessor,
        OnevisionDataset,
        "<image>",
        lambda n: "<image>" * n,
        True,
    ),
    "internvl": (
        build_tiny_internvl,
        InternVLPreprocessor,
        InternVLDataset,
        "<IMG_CONTEXT>",
        lambda n: "<img>" + "<IMG_CONTEXT>" * n + "</img>",
        True,
    ),
}
VIDEO_MARKERS = {"llava": "<video>", "qwen2_vl": "<|video_pad|>", "llava_onevision": "<video>", "internvl": "<video>"}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("chat_template_data")
    path, images = write_llava_dataset(root / "data", 8, seed=11, text_only=0.25)
    plain = root / "plain.json"
    shutil.copy(path, plain)
    add_video_records(path, root / "videos", 2, seed=11)
    return plain, path, images, root / "videos"


def model_with_template(family: str, folder: Path, *, legacy: bool = False) -> tuple[Path, str]:
    """A tiny model of ``family`` shipping :func:`chat_template` (in ``chat_template.jinja``, or in
    a legacy processor ``chat_template.json``)."""
    build, _, _, image, _, _ = FAMILIES[family]
    model = build(folder)
    template = chat_template(image, VIDEO_MARKERS[family], images_first=family == "llava_onevision")
    if legacy:
        (model / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    else:
        (model / "chat_template.jinja").write_text(template)
    return model, template


def supervised_runs(tokenizer, ids: list[int], supervised: list[bool]) -> list[str]:
    """The decoded text of every run of consecutive supervised tokens."""
    runs, current = [], []
    for token, label in zip(ids, supervised):
        if label:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


CONVERSATION = [
    ("human", "<image>\nwhat is in the picture?"),
    ("gpt", "a red car near the sea."),
    ("human", "and this one <image> ?"),
    ("gpt", "hi there, thanks!"),
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_checkpoint_template_gives_the_processors_tokens_and_assistant_only_labels(family, tmp_path, data):
    model, template = model_with_template(family, tmp_path / "m", legacy=family == "internvl")
    _, preprocessor_class, dataset_class, image, block, videos = FAMILIES[family]
    pre = preprocessor_class.from_pretrained(model)
    assert pre.chat_template is not None and pre.chat_template.source == template
    image_tokens = [5, 9]
    encoded = pre.encode_media(CONVERSATION, image_tokens)
    # the reference: render, expand each marker in the text as the processor does, tokenize
    messages = pre.chat_template.messages([("user" if r == "human" else "assistant", v) for r, v in CONVERSATION], None)
    rendered = pre.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert rendered.startswith("[system]\nBe brief.</s>\n[user]\n" + image)
    pieces = rendered.split(image)
    expanded = pieces[0] + block(image_tokens[0]) + pieces[1] + block(image_tokens[1]) + pieces[2]
    assert encoded.input_ids == pre.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert supervised_runs(pre.tokenizer, encoded.input_ids, encoded.supervised) == [
        "a red car near the sea." + END,
        "hi there, thanks!" + END,
    ]
    # the shape policy's counts are the dataset's tensors, for every record (videos included)
    plain, with_videos, images, video_folder = data
    path = with_videos if videos else plain
    policy = pre.policy()
    shapes = list(read_dataset(path, policy, image_folder=images, video_folder=video_folder))
    assert any(shape.image_sizes for shape in shapes) and (not videos or any(s.video_frames for s in shapes))
    dataset = dataset_class(shapes, load_llava_records(path), pre, images, video_folder=video_folder)
    for i, shape in enumerate(shapes):
        item = dataset[i]  # raises when the encoding disagrees with the shape's counts
        assert item.input_ids.numel() == shape.llm_tokens
        assert int((item.targets != -100).sum()) == shape.label_tokens > 0
    # the policy names the template; the built-in one keeps its name
    builtin = preprocessor_class.from_pretrained(model, chat_template=False)
    assert builtin.chat_template is None
    assert policy.tokenizer_id.startswith("chat_template:")
    assert not builtin.policy().tokenizer_id.startswith("chat_template:")


def test_llava_tokens_equal_the_real_processors_under_its_template(tmp_path):
    from PIL import Image
    from transformers import AutoProcessor

    model, _ = model_with_template("llava", tmp_path / "m")
    pre = LlavaPreprocessor.from_pretrained(model)
    processor = AutoProcessor.from_pretrained(model)
    messages = pre.chat_template.messages(
        [("user", v) if r == "human" else ("assistant", v) for r, v in CONVERSATION], None
    )
    text = processor.apply_chat_template(messages, tokenize=False)
    images = [Image.new("RGB", (40, 30)), Image.new("RGB", (20, 50))]
    reference = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    assert pre.encode(CONVERSATION, 2).input_ids == reference


def test_a_cost_model_profiled_under_the_builtin_template_is_refused_naming_both_policies(tmp_path):
    plain = build_tiny_llava(tmp_path / "plain")
    builtin = LlavaPreprocessor.from_pretrained(plain)
    profiled = FittedCostModel().fit(synthetic_profile(), builtin.policy())
    assert builtin.identity().startswith("llava-v1 system:")  # the fallback's identity as before issue 29
    check_policy(profiled, LlavaPreprocessor.from_pretrained(plain, chat_template=False).policy())
    model, _ = model_with_template("llava", tmp_path / "m")
    templated = LlavaPreprocessor.from_pretrained(model).policy()
    with pytest.raises(
        ValueError, match=r"policy 'llava:plain'.*policy 'llava:m'.*tokenizer: 'llava-v1.*chat_template:"
    ):
        check_policy(profiled, templated)


def test_a_qwen2_vl_tokenizer_without_chatml_tokens_is_accepted_with_its_own_template(tmp_path):
    from dflop_ds.models.hf.base.folder import load_text_and_image_parts
    from dflop_ds.testing.hf_tiny import SPECIAL_TOKENS, build_tokenizer

    _, image_processor, config = load_text_and_image_parts(build_tiny_qwen2_vl(tmp_path / "m"))
    pads = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    tokenizer = build_tokenizer(SPECIAL_TOKENS[:4] + tuple(pads.values()), pads)  # no <|im_start|>, <|im_end|>
    config.image_token_id, config.video_token_id = (tokenizer.convert_tokens_to_ids(t) for t in pads.values())
    with pytest.raises(ValueError, match=r"no <\|im_start\|> token"):
        Qwen2VLPreprocessor(tokenizer, image_processor, config, chat_template=False)
    template = chat_template("<|image_pad|>", "<|video_pad|>")
    pre = Qwen2VLPreprocessor(tokenizer, image_processor, config, chat_template=template)
    encoded = pre.encode([("human", "<image> hi"), ("gpt", "hi there")], [3])
    assert encoded.input_ids.count(pre.image_token_id) == 3
    assert supervised_runs(tokenizer, encoded.input_ids, encoded.supervised) == ["hi there" + END]


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    model, _ = model_with_template("llava", tmp_path / "m")
    rewriting = (
        "{% for m in messages %}{{ m['role'] if loop.last else 'x' }}: {{ m['content'][0]['text'] }}\n{% endfor %}"
    )
    pre = LlavaPreprocessor.from_pretrained(model, chat_template=rewriting)
    with pytest.raises(ValueError, match="renders turn 1 differently once later turns follow"):
        pre.encode([("human", "hi"), ("gpt", "hello"), ("human", "and?")], 0)


def test_a_template_that_drops_images_is_refused_by_name(tmp_path):
    model, _ = model_with_template("llava", tmp_path / "m")
    text_only = (
        "{% for m in messages %}{% for c in m['content'] if c['type'] == 'text' %}{{ c['text'] }}{% endfor %}"
        "\n{% endfor %}"
    )
    pre = LlavaPreprocessor.from_pretrained(model, chat_template=text_only)
    with pytest.raises(ValueError, match=r"writes 0 image marker\(s\) \('<image>'\) for 1 image"):
        pre.encode([("human", "<image> hi"), ("gpt", "hello")], 1)


def test_a_saved_preprocessor_keeps_a_legacy_template(tmp_path):
    """Training saves the tokenizer and image processor; a template read from a legacy
    ``chat_template.json`` is written next to them, so the trained model tokenizes as before."""
    from dflop_ds.models.hf.base.folder import save_text_and_image_parts

    model, template = model_with_template("internvl", tmp_path / "m", legacy=True)
    saved = tmp_path / "saved"
    save_text_and_image_parts(InternVLPreprocessor.from_pretrained(model), saved)
    shutil.copy(model / "config.json", saved / "config.json")
    reloaded = InternVLPreprocessor.from_pretrained(saved)
    assert reloaded.chat_template is not None and reloaded.chat_template.source == template


#: ChatML as the built-in Qwen2-VL template writes it, as a Jinja template
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_tokenizes_as_the_builtin_one_keeps_its_policy_and_cost_models(tmp_path):
    """The policy identity changes iff the counts do: a checkpoint template that gives the built-in
    ChatML's tokens keeps the built-in identity (a cost model profiled before is accepted); the same
    template with another default system message counts otherwise and is refused."""
    model = build_tiny_qwen2_vl(tmp_path / "m")
    builtin = Qwen2VLPreprocessor.from_pretrained(model, chat_template=False)
    alike = Qwen2VLPreprocessor.from_pretrained(model, chat_template=CHATML)
    turns = [("human", "<image>\nwhat is it?"), ("gpt", "a car."), ("human", "and <image>?"), ("gpt", "a tree")]
    assert alike.encode(turns, [4, 6]) == builtin.encode(turns, [4, 6])
    assert alike.builtin_counts and alike.identity() == builtin.identity()
    profiled = FittedCostModel().fit(synthetic_profile(), builtin.policy())
    check_policy(profiled, alike.policy())
    other = Qwen2VLPreprocessor.from_pretrained(model, chat_template=CHATML.replace("helpful", "useful"))
    assert not other.builtin_counts and other.identity().startswith("chat_template:")
    with pytest.raises(ValueError, match=r"tokenizer: 'qwen2-vl-chatml .*' vs 'chat_template:"):
        check_policy(profiled, other.policy())


def test_a_malformed_legacy_template_file_is_named(tmp_path):
    from dflop_ds.models.hf.base.chat_template import checkpoint_chat_template

    (tmp_path / "chat_template.json").write_text('{"chat_template": ')
    with pytest.raises(ValueError, match=r"chat_template.json: not a JSON chat template file"):
        checkpoint_chat_template(model_dir=tmp_path)


def test_a_template_that_raises_makes_a_bad_record_not_a_crash(tmp_path):
    model, _ = model_with_template("llava", tmp_path / "m")
    strict = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'][0]['text'] }}\n{% endfor %}"
    )
    pre = LlavaPreprocessor.from_pretrained(model, chat_template=strict)
    assert pre.count([("human", "hi"), ("gpt", "hello")], [])[1] > 0
    with pytest.raises(ValueError, match="chat template fails on this conversation: roles must alternate"):
        pre.count([("gpt", "hello"), ("human", "hi")], [])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_first_system_turn_is_the_conversations_system_message_and_a_later_one_is_refused(family, tmp_path):
    """ms-swift and LLaMA-Factory datasets and HF chat templates take a first ``system`` message;
    it replaces the template's own (or the built-in one's) for that conversation, in the tokens
    and in the shape counts alike."""
    model, template = model_with_template(family, tmp_path / "m")
    preprocessor_class = FAMILIES[family][1]
    image_tokens = [5, 9]
    with_system = [("system", "Answer in one line."), *CONVERSATION]
    for choice in (True, False):  # the checkpoint's template, the built-in one
        pre = preprocessor_class.from_pretrained(model, chat_template=choice)
        told = preprocessor_class.from_pretrained(model, chat_template=choice, system="Answer in one line.")
        encoded = pre.encode_media(with_system, image_tokens)
        assert encoded.input_ids == told.encode_media(CONVERSATION, image_tokens).input_ids
        assert encoded.input_ids != pre.encode_media(CONVERSATION, image_tokens).input_ids
        assert pre.count(with_system, image_tokens) == told.count(CONVERSATION, image_tokens)
    pre = preprocessor_class.from_pretrained(model)
    user_turns = [("user" if r == "human" else "assistant", v) for r, v in CONVERSATION]
    messages = pre.chat_template.messages(user_turns, "Answer in one line.")
    rendered = pre.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert rendered.startswith("[system]\nAnswer in one line.")
    assert "Be brief." not in pre.tokenizer.decode(pre.encode_media(with_system, image_tokens).input_ids)
    with pytest.raises(ValueError, match=r"conversations\[2\]\.from: a system turn after the first"):
        pre.encode_media([*CONVERSATION[:2], ("system", "late"), *CONVERSATION[2:]], image_tokens)
    with pytest.raises(ValueError, match=r"conversations\[0\]\.value: an image or video placeholder"):
        pre.encode_media([("system", "<image> look"), *CONVERSATION], [5, 9, 3])
