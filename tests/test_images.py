"""Images in prompts (images.py): tiny random vision-language models built here (LLaVA, LLaVA-NeXT and
ViP-LLaVA: a CLIP vision tower; Idefics3: a SigLIP-like one; each with a Llama language model; Gemma 3: a
SigLIP tower and a Gemma 3 language model of windowed and full layers, whose image tokens see each
other; PaliGemma and PaliGemma 2: a SigLIP tower and a Gemma or Gemma 2 language model, whose whole prompt
sees itself), their greedy output equal to HF `generate` with the same images token for token, through
the engine and through tritonserver's `image` input (vllm_backend's)."""

import base64
import functools
import io
import random

import numpy as np
import pytest
import torch

from conftest import DEFAULT_MODEL, assert_all_blocks_free, serve, stream_to_the_end
from inflight import LLM, SamplingParams

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PLACEHOLDER = "<image>"
IMAGE_SIZE, PATCH = 30, 6  # 25 patches: 25 image tokens an image (the class token dropped)


# Gemma 3's placeholder is its start-of-image token, which its processor follows with the image's tokens
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
GEMMA3_IMAGE_TOKENS = 16
PALIGEMMA_IMAGE_TOKENS = 16


def placeholder(model_type: str) -> str:
    return GEMMA3_TOKENS["boi_token"] if model_type == "gemma3" else PLACEHOLDER


def _tokenizer(*special: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def _tiny_gemma3():
    """A tiny Gemma 3: a SigLIP tower of 8 x 8 patches pooled to 16 tokens an image, a language model whose
    windowed layers (a window of 24 tokens, beyond an image's 16) alternate with full ones."""
    import transformers as tf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL, extra_special_tokens=GEMMA3_TOKENS)
    text = tf.Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                               layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=1024,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=4)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             mm_tokens_per_image=GEMMA3_IMAGE_TOKENS, image_token_index=tokenizer.image_token_id,
                             boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                             initializer_range=0.2)
    processor = tf.Gemma3Processor(tf.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                                   image_seq_length=GEMMA3_IMAGE_TOKENS)
    return config, tf.Gemma3ForConditionalGeneration, processor


def _tiny_paligemma(windowed: bool):
    """A tiny PaliGemma: a SigLIP tower of 4 x 4 patches, 16 tokens an image, and a Gemma language model
    (PaliGemma 2's: Gemma 2, whose windowed layers of 24 tokens alternate with full ones, the window shorter
    than a prompt of two images) that reads its whole prompt both ways."""
    import transformers as tf

    image_processor = tf.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    image_processor.image_seq_length = PALIGEMMA_IMAGE_TOKENS
    processor = tf.PaliGemmaProcessor(image_processor, tokenizer=_tokenizer(PLACEHOLDER))
    tokenizer = processor.tokenizer  # (with the location and segmentation tokens it adds)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2, tie_word_embeddings=False)
    text = (tf.Gemma2Config(sliding_window=24, final_logit_softcapping=None, query_pre_attn_scalar=16, **sizes)
            if windowed else tf.GemmaConfig(**sizes))
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    config = tf.PaliGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=64,
                                image_token_index=processor.image_token_id, initializer_range=0.2,
                                tie_word_embeddings=False)
    return config, tf.PaliGemmaForConditionalGeneration, processor


def _text_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=2,
                       bos_token_id=1, tie_word_embeddings=False)


def _clip(num_hidden_layers: int = 2):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
                            num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)


def make_tiny_vlm(model_type: str, out) -> str:
    """A tiny random checkpoint of a vision-language model type, with its processor, in `out`."""
    import transformers as tf

    crop = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    if model_type == "gemma3":
        config, model, processor = _tiny_gemma3()
    elif model_type.startswith("paligemma"):  # paligemma (Gemma), paligemma2 (Gemma 2)
        config, model, processor = _tiny_paligemma(windowed=model_type == "paligemma2")
    elif model_type == "idefics3":  # (SmolVLM): a SigLIP-like tower, pixel shuffle, images as fake-token spans
        tokenizer = _tokenizer("<fake_token_around_image>", PLACEHOLDER, "<end_of_utterance>", "<global-img>")
        vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=32, patch_size=8)
        config = tf.Idefics3Config(vision_config=vision.to_dict(), text_config=_text_config(len(tokenizer)).to_dict(),
                                   scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids(PLACEHOLDER),
                                   initializer_range=0.2)
        model = tf.Idefics3ForConditionalGeneration
        sizes = {"longest_edge": 32}
        processor = tf.Idefics3Processor(tf.Idefics3ImageProcessor(do_image_splitting=False, size=sizes,
                                                                   max_image_size=sizes),
                                         tokenizer=tokenizer, image_seq_len=4)
    else:  # llava, vipllava (several layers' features), llava_next (tiles of the image at the grid's
        # resolutions, and a newline vector a row)
        tokenizer = _tokenizer(PLACEHOLDER)
        image_token = tokenizer.convert_tokens_to_ids(PLACEHOLDER)
        common = dict(vision_config=_clip(), text_config=_text_config(len(tokenizer)), vision_feature_layer=-2,
                      vision_feature_select_strategy="default", initializer_range=0.2)
        words = dict(tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
                     image_token=PLACEHOLDER, num_additional_image_tokens=1)
        clip_processor = tf.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size=crop)
        if model_type == "llava":
            config = tf.LlavaConfig(image_token_id=image_token, **common)
            model = tf.LlavaForConditionalGeneration
            processor = tf.LlavaProcessor(clip_processor, **words)
        elif model_type == "vipllava":
            config = tf.VipLlavaConfig(vision_config=_clip(num_hidden_layers=4), text_config=common["text_config"],
                                       image_token_index=image_token, vision_feature_layers=[-2, -3, -4],
                                       initializer_range=0.2)
            model = tf.VipLlavaForConditionalGeneration
            processor = tf.LlavaProcessor(clip_processor, **words)
        else:
            grid = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE]]
            config = tf.LlavaNextConfig(image_token_index=image_token, image_grid_pinpoints=grid, **common)
            model = tf.LlavaNextForConditionalGeneration
            processor = tf.LlavaNextProcessor(tf.LlavaNextImageProcessor(
                size={"shortest_edge": IMAGE_SIZE}, crop_size=crop, image_grid_pinpoints=grid), **words)
    torch.manual_seed(0)
    model(config).save_pretrained(out)
    processor.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory):
    """The tiny checkpoint of a model type, made on first use."""
    root = tmp_path_factory.mktemp("vlm")
    return functools.cache(lambda model_type: make_tiny_vlm(model_type, root / model_type))


@pytest.fixture(scope="module")
def tiny_llava(tiny_vlms) -> str:
    return tiny_vlms("llava")


class Reference:
    """HF transformers' own model of the checkpoint and its processor: greedy continuations. `attention`: HF's
    attention implementation (eager for Gemma 2's softcap, which its SDPA ignores)."""

    def __init__(self, model_dir: str, attention: str | None = None):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                 attn_implementation=attention).eval()
        self.processor = AutoProcessor.from_pretrained(model_dir)

    def __call__(self, text: str, images: list | None, max_new_tokens: int = 10) -> list[int]:
        inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(tiny_vlms):
    """HF's model of a model type's checkpoint, made on first use."""
    return functools.cache(lambda model_type: Reference(tiny_vlms(model_type),
                                                        "eager" if model_type == "paligemma2" else None))


@pytest.fixture(scope="module")
def reference(references) -> Reference:
    return references("llava")


def pictures(count: int, seed: int = 0) -> list:
    """Random RGB images of different sizes (the processor resizes and crops them)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (36 + 5 * k, 44 - 3 * k, 3), dtype=np.uint8)) for k in range(count)]


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def opened(images: list) -> list:
    """The images as PIL images, files' bytes opened."""
    return [Image.open(io.BytesIO(i)) if isinstance(i, bytes) else i for i in images]


def with_images(text: str, images: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": images}}


# Chunks of 16 tokens cut through the images' tokens; a pool this small preempts and recomputes.
CHUNKED_PREEMPTED = dict(max_num_batched_tokens=16, max_num_seqs=8, num_kv_blocks=14, block_size=8,
                         packed_weights=False)


@pytest.mark.parametrize("model_type,settings", [
    ("llava", {}),  # the CPU's defaults: packed weights, fused layers
    ("llava", CHUNKED_PREEMPTED),
    ("llava_next", {}),
    ("vipllava", {}),
    ("idefics3", CHUNKED_PREEMPTED),
    ("gemma3", {}),
    ("gemma3", CHUNKED_PREEMPTED),  # (a chunk of 16 tokens holds an image's 16 whole, or none of them)
], ids=["llava", "llava-chunked-preempted", "llava_next", "vipllava", "idefics3-chunked-preempted", "gemma3",
        "gemma3-chunked-preempted"])
def test_images_equal_hf_generate(tiny_vlms, references, model_type, settings):
    """Prompts of one image, of two, of an image given as a file's bytes, and of text alone, in one
    batch: each output HF's for the same text and images."""
    a, b, c = pictures(3)
    prompts = [(text.replace(PLACEHOLDER, placeholder(model_type)), images) for text, images in [
        ("USER: <image>\nWhat is shown here? ASSISTANT:", [a]),
        ("Compare <image> with <image>, please.", [b, c]),
        ("<image> described in a word:", [png(c)]),
        ("A prompt of text alone, beside them", [])]]
    reference = references(model_type)
    llm = LLM(tiny_vlms(model_type), **settings)
    outs = llm.generate([with_images(text, images) if images else text for text, images in prompts],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for (text, images), out in zip(prompts, outs):
        decoded = opened(images)
        assert out.outputs[0].token_ids == reference(text, decoded, 24), text
        assert len(out.prompt_token_ids) == len(reference.processor(text=text, images=decoded or None)["input_ids"][0])
    if settings:
        assert llm.stats()["num_preemptions"] > 0
    llm.block_manager.check_all_free()


def test_the_prefix_cache_finds_an_image_again_and_tells_images_apart(tiny_llava, reference):
    """The same text and image again find their blocks; another image of the same size after the same
    text finds only the text's blocks before it, and its output is HF's for its own image."""
    first, other = pictures(2, seed=5)
    other = other.resize(first.size)
    text = "Here is a picture for you to see: <image> and a question about it"
    llm = LLM(tiny_llava, block_size=8, num_kv_blocks=64)
    before_image = len(llm.tokenizer(text.split(PLACEHOLDER)[0])["input_ids"]) // 8 * 8
    hits = []
    for image in (first, first, other):
        start = llm.stats()["prefix_cache_hit_tokens"]
        out = llm.generate([with_images(text, [image])], GREEDY)[0]
        hits.append(llm.stats()["prefix_cache_hit_tokens"] - start)
        assert out.outputs[0].token_ids == reference(text, [image])
    full_blocks = (len(out.prompt_token_ids) - 1) // 8 * 8  # (a prompt's last token is always computed)
    assert before_image > 0 and hits == [0, full_blocks, before_image]
    llm.block_manager.check_all_free()


def test_an_image_sent_again_skips_the_vision_tower(tiny_llava, reference):
    """The same image again (another text around it: a chat's next turn) takes its vectors from the cache;
    another image of the same size runs the tower; a cache holding one prompt's vectors keeps the latest;
    none kept with image_cache_memory 0. Every output HF's."""
    first, other = pictures(2, seed=7)
    other = other.resize(first.size)
    turns = [("<image> What is it?", first), ("USER: <image> What is it? ASSISTANT: a cat. USER: Sure?", first),
             ("<image> What is it?", other), ("<image> And this?", first)]
    one_image = 25 * 64 * 4  # its 25 vectors of 64 float32s
    for memory, encoded in ((1 << 20, [1, 1, 2, 2]), (one_image, [1, 1, 2, 3]), (0, [1, 2, 3, 4])):
        llm = LLM(tiny_llava, image_cache_memory=memory)
        counts = []
        for text, image in turns:
            out = llm.generate([with_images(text, [image])], GREEDY)[0]
            assert out.outputs[0].token_ids == reference(text, [image])
            counts.append(llm.stats()["images_encoded_total"])
        assert counts == encoded, memory
        assert llm.stats()["images_cached_total"] == len(turns) - encoded[-1]
    with pytest.raises(ValueError, match="image_cache_memory must be a number of bytes"):
        LLM(tiny_llava, image_cache_memory=-1)


def test_a_lora_adapter_of_the_whole_checkpoint(tiny_llava, tmp_path):
    """A peft adapter trained on the whole LLaVA (its layers named model.language_model.layers...) serves
    images and text beside the base model, each output peft's model's; one that targets the vision tower
    is refused by name at start-up (the engine adapts the language model only)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForImageTextToText

    def adapter(name: str, targets: str, seed: int) -> str:
        torch.manual_seed(seed)
        base = AutoModelForImageTextToText.from_pretrained(tiny_llava, dtype=torch.float32)
        config = LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=targets)
        get_peft_model(base, config).save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    language = adapter("language", r".*language_model.*\.(q_proj|v_proj|down_proj)", 3)
    vision = adapter("vision", r".*vision_tower.*\.(q_proj|v_proj)", 4)
    reference = Reference(tiny_llava)
    base_reference = Reference(tiny_llava)
    reference.model = PeftModel.from_pretrained(reference.model, language).eval()
    image = pictures(1, seed=12)[0]
    text = "<image> What does the adapter say?"
    llm = LLM(tiny_llava, lora_modules={"language": language})
    outs = llm.generate([with_images(text, [image]), with_images(text, [image]), "Text alone"], GREEDY,
                        lora_name=["language", None, "language"])
    assert outs[0].outputs[0].token_ids == reference(text, [image])
    assert outs[1].outputs[0].token_ids == base_reference(text, [image]) != outs[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == reference("Text alone", [])
    with pytest.raises(ValueError, match="'model.vision_tower.encoder.layers.0.self_attn.q_proj': not a linear"):
        LLM(tiny_llava, lora_modules={"vision": vision})


def test_gemma3_images_are_computed_whole_and_found_again(tiny_vlms, references):
    """Gemma 3's image tokens see each other, so an image is computed in one chunk: a budget of 20 tokens
    stops a chunk before an image it would cut, then takes its 16 tokens whole. The prefix cache finds the
    same prompt again up to its last block, but never a part of an image: a prompt that ends in its image is
    found only up to the block the image begins in. Every output HF's; a budget below an image's tokens is
    refused by name."""
    reference = references("gemma3")
    llm = LLM(tiny_vlms("gemma3"), max_num_batched_tokens=20, max_num_seqs=4, block_size=8, num_kv_blocks=64)
    image = pictures(1, seed=3)[0]
    schedule, chunks = llm.scheduler.schedule, []

    def recorded():
        batch = schedule()
        chunks.append([(seq.num_computed_tokens, n) for seq, n in zip(batch.seqs, batch.num_tokens)])
        return batch

    llm.scheduler.schedule = recorded
    runs = []
    # images at positions [8, 24) of 30 tokens, then [13, 29) of 31: the text's 2 last tokens after it
    texts = ("a question about the picture, <start_of_image> what is it?",
             "Here is a long question about the picture you see: <start_of_image>")
    for text in texts:
        for _ in range(2):
            start = llm.stats()["prefix_cache_hit_tokens"]
            chunks.clear()
            out = llm.generate([with_images(text, [image])], GREEDY)[0]
            assert out.outputs[0].token_ids == reference(text, [image]), text
            ids = out.prompt_token_ids
            first = next(k for k, t in enumerate(ids) if t >= llm.runner.hf_config.vocab_size)
            runs.append((llm.stats()["prefix_cache_hit_tokens"] - start, first, len(ids), [c[0] for c in chunks]))
    assert [run[1:3] for run in runs] == [(8, 30)] * 2 + [(13, 31)] * 2
    assert [run[0] for run in runs] == [0, 24, 0, 8]
    assert [run[3][:3] for run in runs] == [[(0, 8), (8, 20), (28, 2)], [(24, 6), (30, 1), (31, 1)],
                                            [(0, 13), (13, 18), (31, 1)], [(8, 5), (13, 18), (31, 1)]]
    llm.block_manager.check_all_free()
    with pytest.raises(ValueError, match=r"an image of 16 tokens, which see each other, is computed in one step: "
                                         r"more than max_num_batched_tokens \(12\)"):
        small = LLM(tiny_vlms("gemma3"), max_num_batched_tokens=12, max_num_seqs=4)
        small.generate([with_images(texts[0], [image])], GREEDY)


PALIGEMMA_PROMPTS = [("<image>caption en", 0), ("<image><image>answer en which of the two is larger?", 1),
                     ("describe <image> in detail", 2), ("<image>question: what colour is it?", 3)]


@pytest.mark.parametrize("model_type,settings", [
    ("paligemma", {}),
    ("paligemma2", {}),
    # chunks of at most 48 tokens, each prompt whole in one; a pool this small preempts and recomputes
    ("paligemma2", dict(max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=16, block_size=8,
                        packed_weights=False)),
], ids=["paligemma", "paligemma2", "paligemma2-chunked-preempted"])
def test_paligemma_prompts_see_themselves_whole(tiny_vlms, references, model_type, settings):
    """PaliGemma's whole prompt, text and images, sees itself (its tokens after an image see it, those
    before it too); its answer's tokens attend causally. Prompts of one and two images, one after text, one
    longer than PaliGemma 2's window of 24 (whose tokens see the whole prompt past it, as HF's mask has
    it), one image given as a file: each output HF's; the same prompt again is computed again whole."""
    a, b, c = pictures(3, seed=11)
    images = [[a], [b, c], [png(c)], [b]]
    prompts = [(text, images[k]) for text, k in PALIGEMMA_PROMPTS]
    reference = references(model_type)
    llm = LLM(tiny_vlms(model_type), **settings)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([with_images(text, files) for text, files in prompts], params)
        for (text, files), out in zip(prompts, outs):
            decoded = opened(files)
            assert out.outputs[0].token_ids == reference(text, decoded, 16), text
    assert len(outs[1].prompt_token_ids) > 24  # (past PaliGemma 2's window)
    if settings:
        assert llm.stats()["num_preemptions"] > 0
    else:
        assert llm.stats()["prefix_cache_hit_tokens"] == 0
    llm.block_manager.check_all_free()


def test_paligemma_takes_prompts_with_images_alone(tiny_vlms):
    """A prompt without images (text, token ids) is refused by name, as PaliGemma's processor refuses it;
    so is a prompt of more tokens than a step's budget (it is computed in one step)."""
    llm = LLM(tiny_vlms("paligemma"), max_num_batched_tokens=24, max_num_seqs=4)
    for prompt in ("caption en", [5, 6, 7]):
        with pytest.raises(ValueError, match="this model reads each prompt whole together with its images"):
            llm.add_request("text", prompt, GREEDY)
    with pytest.raises(ValueError, match=r"a prompt \(its images' tokens included\) of 35 tokens, which see each "
                                         r"other, is computed in one step: more than max_num_batched_tokens \(24\)"):
        llm.add_request("long", with_images("<image><image>caption", pictures(2)), GREEDY)
    assert len(llm.add_request("short", with_images("<image>caption", pictures(1)), GREEDY)) == 19
    while llm.has_unfinished():
        llm.step()
    llm.block_manager.check_all_free()


def test_a_prompt_that_sees_itself_is_found_again_only_whole():
    """Each token of a prompt that sees itself depends on the whole prompt: its blocks' keys for the prefix
    cache are led by the whole prompt's digest, so a prompt that begins another shares no block with it
    (its answer could otherwise find the longer prompt's blocks), the same prompt again all of them."""
    from inflight.prompt_embeds import resolve

    rows = torch.randn(2, 8)
    keys = []
    for ids in ([100, 101, 5, 6], [100, 101, 5, 6], [100, 101, 5, 6, 7, 8]):
        ids, embeds = resolve({"prompt_token_ids": ids, "prompt_embedding_table": rows}, 100, 8, torch.float32, 64)
        plain = embeds.cache_key(ids[:2])
        embeds.attend_within_prompt(ids)
        assert embeds.spans == [(0, len(ids))]
        keys.append([embeds.cache_key(ids[:2]), embeds.cache_key(ids[2:4], 2), embeds.cache_key([7, 8], 4), plain])
    assert keys[0] == keys[1]
    assert keys[0][3] == keys[2][3]  # (row by row, the prompts' first tokens agree)
    assert keys[0][0] != keys[2][0] and keys[0][1] != keys[2][1]
    assert keys[0][0][1:] == keys[0][3] and keys[0][1][1:] == (5, 6)
    assert keys[0][2] == (7, 8)  # (past the prompt: as any token)


def test_a_span_attends_as_hf_masks_it():
    """attend_within_spans against a dense mask built as HF builds Gemma 3's (AND(window, OR(causal, same
    image))) and PaliGemma's (OR(AND(window, causal), same prefix): a span sees itself past the window): a
    window shorter than the span, grouped heads, a softcap and sinks, keys in a paged cache of scattered
    blocks, rows outside the spans untouched."""
    from inflight.ops import attend_within_spans

    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    seq_len, spans = 30, [(5, 17), (20, 29)]
    query = torch.randn(3 + seq_len, heads, dim)  # (the sequence's rows after another's 3)
    keys, values = torch.randn(seq_len, kv_heads, dim), torch.randn(seq_len, kv_heads, dim)
    table = torch.randperm(16)[:8]
    key_cache, value_cache = torch.zeros(16, block, kv_heads, dim), torch.zeros(16, block, kv_heads, dim)
    positions = torch.arange(seq_len)
    for cache, x in ((key_cache, keys), (value_cache, values)):
        cache[table[positions // block], positions % block] = x
    sinks = torch.randn(heads)
    for window, softcap, with_sinks, past_window in ((None, None, False, False), (7, 5.0, True, False),
                                                     (100, None, True, False), (7, None, False, True),
                                                     (4, 5.0, True, True)):
        out = torch.full_like(query, 7.0)
        attend_within_spans(out, query, key_cache, value_cache, table[None].repeat(2, 1),
                            np.array([[1, 3 + start, start, end] for start, end in spans]), 0.3, window, softcap,
                            sinks if with_sinks else None, past_window=past_window)
        group = torch.full((seq_len,), -1)
        for k, (start, end) in enumerate(spans):
            group[start:end] = k
        q, k = positions[:, None], positions[None, :]
        causal, same_span = k <= q, (group[:, None] == group[None, :]) & (group[:, None] >= 0)
        in_window = torch.ones_like(causal) if window is None else k > q - window
        visible = (causal & in_window) | same_span if past_window else (causal | same_span) & in_window
        scores = torch.einsum("qhd,khd->hqk", query[3:], keys.repeat_interleave(2, dim=1)) * 0.3
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible, float("-inf"))
        if with_sinks:
            scores = torch.cat([scores, sinks[:, None, None].expand(heads, seq_len, 1)], dim=-1)
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :seq_len], values.repeat_interleave(2, dim=1))
        inside = torch.zeros(seq_len, dtype=torch.bool)
        for start, end in spans:
            inside[start:end] = True
            torch.testing.assert_close(out[3 + start:3 + end], expected[start:end], atol=1e-5, rtol=1e-5)
        outside = torch.ones(seq_len + 3, dtype=torch.bool)
        outside[3:][inside] = False
        assert (out[outside] == 7.0).all()


def test_an_image_block_is_found_again_only_with_its_whole_span():
    """A token of a span that sees itself depends on the span's rows after it too: its digest for the prefix
    cache takes in the whole span's, so two images whose first rows agree share no block of them."""
    from inflight.prompt_embeds import resolve

    rows = torch.randn(4, 8)
    other = rows.clone()
    other[3] += 1
    keys = []
    for table in (rows, rows.clone(), other):
        ids, embeds = resolve({"prompt_token_ids": [5, 100, 101, 6, 102, 103], "prompt_embedding_table": table}, 100,
                              8, torch.float32, 64)
        plain = embeds.cache_key(ids)
        embeds.attend_within_runs(ids)
        assert embeds.spans == [(1, 3), (4, 6)]
        keys.append((plain, embeds.cache_key(ids)))
    assert keys[0] == keys[1]
    assert keys[0][0][:5] == keys[2][0][:5]  # row by row, the first three rows agree
    assert keys[0][1][:3] == keys[2][1][:3] and keys[0][1][4] != keys[2][1][4]  # ... not with the span after


@pytest.mark.parametrize("model_type", ["llava", "paligemma2"])
def test_completions_and_beams_over_an_image(tiny_vlms, references, model_type):
    """n greedy completions are each HF's; a beam search of width 1 equals greedy too (PaliGemma 2's
    completions sharing the blocks of a prompt that sees itself)."""
    image = pictures(1, seed=9)[0]
    text = "<image> Tell me about it."
    llm = LLM(tiny_vlms(model_type))
    expected = references(model_type)(text, [image])
    out = llm.generate([with_images(text, [image])], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                                     n=2))[0]
    assert [c.token_ids for c in out.outputs] == [expected, expected]
    beams = llm.generate([with_images(text, [image])], SamplingParams(max_tokens=10, beam_width=1, ignore_eos=True,
                                                                       temperature=0))[0]
    assert beams.outputs[0].token_ids == expected
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_requests_with_images(tiny_vlms, references, seed):
    """Random prompts of 0 to 3 images of random sizes (some as files), greedy and sampled, n, aborts, a
    pool small enough to preempt and to refuse the longest: every greedy completion HF's, every refusal
    the limit's, every block back."""
    rnd, rng = random.Random(seed), np.random.default_rng(seed)
    model_type = ("llava", "llava_next", "gemma3")[seed % 3]
    words = "the a cat red sky sea what is this tell me about it compare and".split()
    llm = LLM(tiny_vlms(model_type), max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=24, block_size=8,
              max_images_per_prompt=2)
    requests = {}
    for k in range(12):
        count = rnd.choice([0, 1, 1, 2, 3])
        text = placeholder(model_type).join(" ".join(rnd.choices(words, k=rnd.randint(0, 6)))
                                            for _ in range(count + 1)) or "hi"
        images = [Image.fromarray(rng.integers(0, 256, (rnd.randint(8, 80), rnd.randint(8, 80), 3), dtype=np.uint8))
                  for _ in range(count)]
        greedy = rnd.random() < 0.6
        params = SamplingParams(max_tokens=rnd.randint(1, 16), temperature=0 if greedy else 1.0, seed=k,
                                ignore_eos=True, n=1 if greedy else rnd.choice([1, 2]))
        files = [png(i) for i in images] if rnd.random() < 0.3 else images
        try:
            llm.add_request(f"r{k}", with_images(text, files) if count else text, params)
        except ValueError as e:
            assert "max_images_per_prompt" in str(e) if count > 2 else "max_model_len" in str(e), e
            continue
        requests[f"r{k}"] = (text, images, params, greedy)
    aborted = {rid: rnd.randint(1, 20) for rid in requests if rnd.random() < 0.2}
    outputs, step = {}, 0
    while llm.has_unfinished():
        step += 1
        for rid in [rid for rid, at in aborted.items() if at == step]:
            llm.abort(rid)
        for delta in llm.step():
            assert not delta.error, delta.error
            outputs.setdefault((delta.request_id, delta.index), []).extend(delta.new_token_ids)
    checked = 0
    for rid, (text, images, params, greedy) in requests.items():
        if greedy and rid not in aborted:
            assert outputs[rid, 0] == references(model_type)(text, images, params.max_tokens), (rid, text)
            checked += 1
    assert checked >= 3
    llm.block_manager.check_all_free()


@pytest.mark.parametrize("prompt,params,message", [
    (with_images("no placeholder", ["IMAGE"]), GREEDY, "0 image placeholders (<image>) for 1 images"),
    (with_images("<image> and <image>", ["IMAGE"]), GREEDY, "2 image placeholders (<image>) for 1 images"),
    ("<image> without its image", GREEDY, "holds the image placeholder (<image>) but no image"),
    (with_images("<image>", [b"not an image file"]), GREEDY, "image 0 could not be read"),
    (with_images("<image>", [3]), GREEDY, "image 0 must be a PIL image or an image file's bytes, got int"),
    (with_images("<image> <image> <image>", ["IMAGE"] * 3), GREEDY, "at most 2 (max_images_per_prompt)"),
    (with_images("<image>", []), GREEDY, "image list is empty"),
    (with_images(["ids"], ["IMAGE"]), GREEDY, "a prompt with images needs its text"),
    ({"prompt": "<image>", "multi_modal_data": {"video": []}}, GREEDY, "multi_modal_data takes images alone"),
    ({"prompt": "<image>", "multi_modal_data": {"image": []}, "extra": 1}, GREEDY, "a prompt with images is"),
    (with_images("<image>", ["IMAGE"]), SamplingParams(truncate_prompt_tokens=5), "would cut a prompt's images"),
    (with_images("<image>", ["IMAGE"]), SamplingParams(prompt_logprobs=1), "prompt_logprobs cannot be measured"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_image_prompts_are_refused_by_name(tiny_llava, reference, prompt, params, message):
    llm = _refusing_llm(tiny_llava)
    data = prompt.get("multi_modal_data", {}) if isinstance(prompt, dict) else {}
    if isinstance(data.get("image"), list):
        data["image"] = [pictures(1)[0] if i == "IMAGE" else i for i in data["image"]]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llm.generate([prompt], params)
    text = "<image> still served"  # and the engine goes on
    assert llm.generate([with_images(text, pictures(1))], GREEDY)[0].outputs[0].token_ids == reference(
        text, pictures(1))
    llm.block_manager.check_all_free()


def test_a_servers_prompt_limit_counts_the_images_tokens(tiny_llava, reference):
    """add_request's max_prompt_tokens (a server's setting) counts each image's 25 tokens, not its placeholder
    alone: 5 tokens of text with an image are 29; refused under 29 before the vision tower runs, served at
    29. max_model_len likewise."""
    llm = LLM(tiny_llava, max_model_len=28)
    prompt = with_images("<image> What is it?", pictures(1, seed=21))
    with pytest.raises(ValueError, match=r"prompt has 29 tokens \(its images' tokens included\), more than "
                                         r"max_model_len \(28\)"):
        llm.add_request("long", prompt, GREEDY)
    llm = _refusing_llm(tiny_llava)
    encoded = llm.stats()["images_encoded_total"]
    with pytest.raises(ValueError, match=r"the prompt has 29 tokens \(its images' tokens included\); this server "
                                         "accepts at most 28"):
        llm.add_request("over", prompt, GREEDY, max_prompt_tokens=28)
    assert llm.stats()["images_encoded_total"] == encoded  # (refused before the tower)
    assert len(llm.add_request("at", prompt, GREEDY, max_prompt_tokens=29)) == 29
    assert llm.stats()["images_encoded_total"] == encoded + 1
    while llm.has_unfinished():
        llm.step()
    llm.block_manager.check_all_free()


def test_a_decompression_bomb_is_refused(tiny_llava, monkeypatch):
    """A file of more pixels than Pillow's limit (lowered here to 1,000) is refused, never decoded."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    bomb = png(Image.new("RGB", (40, 40)))  # 1,600 pixels
    with pytest.raises(ValueError, match="image 0 could not be read: DecompressionBombWarning"):
        _refusing_llm(tiny_llava).generate([with_images("<image>", [bomb])], GREEDY)


_engines: dict = {}


def _refusing_llm(model_dir: str) -> LLM:
    """One engine for every refusal (each refused before anything is queued)."""
    if model_dir not in _engines:
        _engines[model_dir] = LLM(model_dir, max_images_per_prompt=2)
    return _engines[model_dir]


def test_a_text_only_model_takes_no_images(tiny_models):
    llm = LLM(tiny_models["llama"])
    with pytest.raises(ValueError, match="this model \\(llama\\) takes no images"):
        llm.generate([with_images("<image>", pictures(1))], GREEDY)
    with pytest.raises(ValueError, match="max_images_per_prompt must be a positive integer"):
        LLM(tiny_models["llama"], max_images_per_prompt=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("model_type", ["llava", "gemma3", "paligemma2"])
def test_on_a_gpu_beside_cuda_graphs(tiny_vlms, references, model_type):
    """On a GPU (float32; the vision tower there too; decode steps in CUDA graphs; Gemma 3's images' and
    PaliGemma's prompts' spans attended after the Triton kernels): HF's outputs, with a prompt of text alone
    beside the images' prompts (not PaliGemma's, which takes none)."""
    images = pictures(2, seed=4)
    image = placeholder(model_type)
    prompts = [(f"{image} and {image}: what differs?", images), (f"{image} again", images[1:])]
    reference = references(model_type)
    llm = LLM(tiny_vlms(model_type), device="cuda", dtype="float32", num_kv_blocks=64, block_size=16)
    assert llm.runner.graphs is not None
    alone = [] if model_type == "paligemma2" else ["text alone"]
    outs = llm.generate([with_images(t, i) for t, i in prompts] + alone, GREEDY)
    for (text, images), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(text, images)
    assert llm.runner.graphs.replays > 0
    llm.block_manager.check_all_free()


@pytest.fixture(scope="module")
def llava_server(tiny_llava):
    yield from serve(model=tiny_llava, max_images_per_prompt=2, max_image_bytes=16384)


@pytest.mark.server
def test_served_images_equal_hf_generate(llava_server, reference):
    """vllm_backend's `image` input (base64-encoded files, one per element) beside `text_input`: streamed
    output equal to HF's; bad images refused with the reason; every block free after."""
    url = llava_server.grpc_url
    a, b = pictures(2, seed=11)
    text = "Compare <image> with <image>:"
    tokenizer = reference.processor.tokenizer
    images = [base64.b64encode(png(i)).decode() for i in (a, b)]
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    for _ in range(2):  # the second time, the images' vectors come from the cache
        served = stream_to_the_end(url, text, image=images, sampling_parameters=params)
        assert served["error"] is None and served["finals"] == 1 and served["after_final"] == 0
        assert served["text"] == tokenizer.decode(reference(text, [a, b]), skip_special_tokens=True)
    llava_server.wait_for_metric("inflight_images_encoded_total", lambda v: v == 2, timeout=10)
    llava_server.wait_for_metric("inflight_images_cached_total", lambda v: v == 2, timeout=10)
    refusals = {
        "not base64": dict(image=["***"]),
        "(max_image_bytes)": dict(image=["A" * 16388]),
        "could not be read": dict(image=[base64.b64encode(b"not a picture").decode()], prompt="<image>"),
        "at most 2 (max_images_per_prompt)": dict(image=images + images[:1], prompt="<image><image><image>"),
        "2 image placeholders": dict(image=images[:1]),
        "input 'image' goes with 'text_input'": dict(image=images[:1], prompt=None,
                                                     input_ids=np.array([1, 2], dtype=np.int32)),
    }
    for message, inputs in refusals.items():
        prompt = inputs.pop("prompt", text)
        result = stream_to_the_end(url, prompt, quiet_s=0.3, sampling_parameters=params, **inputs)
        assert result["error"] is not None and message in result["error"], (message, result["error"])
        assert result["finals"] == 1
    assert_all_blocks_free(llava_server)


@pytest.fixture(scope="module")
def gemma3_server(tiny_vlms):
    yield from serve(model=tiny_vlms("gemma3"), max_num_batched_tokens=20, max_num_seqs=4, max_prompt_tokens=56)


@pytest.mark.server
def test_served_gemma3_images_equal_hf_generate(gemma3_server, references):
    """Gemma 3 served, chunks of at most 20 tokens: prompts of one and two images, whose tokens see each
    other, streamed equal to HF's output; three images, 60 tokens with their placeholders' expansions, refused
    by max_prompt_tokens (56); every block free after."""
    reference = references("gemma3")
    a, b = pictures(2, seed=13)
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    image = placeholder("gemma3")
    for text, images in ((f"What is in {image}?", [a]), (f"Compare {image} and {image}:", [a, b])):
        sent = [base64.b64encode(png(i)).decode() for i in images]
        served = stream_to_the_end(gemma3_server.grpc_url, text, image=sent, sampling_parameters=params)
        assert served["error"] is None and served["finals"] == 1, served["error"]
        assert served["text"] == reference.processor.tokenizer.decode(reference(text, images), skip_special_tokens=True)
    sent = [base64.b64encode(png(i)).decode() for i in (a, b, a)]
    refused = stream_to_the_end(gemma3_server.grpc_url, f"{image} {image} {image}", image=sent, quiet_s=0.3,
                                sampling_parameters=params)
    assert refused["finals"] == 1 and refused["error"] is not None
    assert "the prompt has 60 tokens (its images' tokens included); this server accepts at most 56" in refused["error"]
    assert_all_blocks_free(gemma3_server)


@pytest.fixture(scope="module")
def paligemma2_server(tiny_vlms):
    yield from serve(model=tiny_vlms("paligemma2"), max_num_batched_tokens=48, max_num_seqs=4)


@pytest.mark.server
def test_served_paligemma2_prompts_equal_hf_generate(paligemma2_server, references):
    """PaliGemma 2 served: prompts of one and two images (the second longer than its window), each seeing
    itself whole, streamed equal to HF's output; a prompt of text alone refused by name; every block free."""
    reference = references("paligemma2")
    a, b = pictures(2, seed=17)
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    for text, images in (("<image>caption en", [a]), ("<image><image>answer en which of the two is larger?", [a, b])):
        sent = [base64.b64encode(png(i)).decode() for i in images]
        served = stream_to_the_end(paligemma2_server.grpc_url, text, image=sent, sampling_parameters=params)
        assert served["error"] is None and served["finals"] == 1, served["error"]
        assert served["text"] == reference.processor.tokenizer.decode(reference(text, images), skip_special_tokens=True)
    refused = stream_to_the_end(paligemma2_server.grpc_url, "caption en", quiet_s=0.3, sampling_parameters=params)
    assert refused["finals"] == 1 and "this model reads each prompt whole together with its images" in refused["error"]
    assert_all_blocks_free(paligemma2_server)
