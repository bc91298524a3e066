"""Images in prompts, for vision-language models (LLaVA, LLaVA-NeXT, ViP-LLaVA, Idefics3 / SmolVLM, Gemma 3,
PaliGemma): each image becomes rows of prompt embeddings.

A request gives a text prompt with the model's image placeholder (`<image>` for LLaVA) where each image
goes, and the images (vLLM's {"prompt": text, "multi_modal_data": {"image": [...]}}). The checkpoint's
own processor (AutoProcessor) expands each placeholder into the image's tokens and prepares its pixels;
the model's own vision tower and projector (`get_image_features`) make one vector per image token, as HF
`generate` does. The prompt then runs as a prompt of embeddings (prompt_embeds.py): its image tokens are
virtual ids reading those vectors, so chunked prefill, preemption, the prefix cache (a row's digest: the
same image is found again, another never), n, beams and tensor parallelism (rank 0 makes the vectors;
the step's message carries them) work as for any prompt.

The engine runs the language model as the text-only causal LM of its config, made of the checkpoint's own
decoder and output head (shared, not copied): packing, fused layers, LoRA and CUDA graphs see the language
model alone. The vision modules stay with the ImageEncoder, which runs them when a request is added, one
request at a time; the vectors of recent prompts' images are kept by a digest of their pixels, so that a
chat sending its image again with every turn runs the vision tower once.
"""

import hashlib
import io
import threading
import warnings
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from .model_support import refuse

# Vision-language model types whose image tokens have 1-D positions, each tested against HF `generate`:
# their image tokens attend as text does (causally), except those of the types below. (Qwen2-VL gives them
# 3-D positions, Mllama reads images by cross-attention: neither is served with images. Mistral 3 would fit,
# untested: its processor needs torchvision.)
IMAGE_MODEL_TYPES = ("llava", "llava_next", "vipllava", "idefics3", "gemma3", "paligemma")
# ... those whose image's tokens see each other, before and after (prompt_embeds.py's spans), within the
# sliding window on windowed layers
IMAGES_SEE_THEMSELVES = ("gemma3",)
# ... and those whose whole prompt sees itself (a prefix language model: PaliGemma's prompt, its images and
# text, attends both ways, past the sliding window too; the tokens it generates attend causally). Such a
# model takes no prompt without images, as its processor takes none. (PaliGemma counts positions from 1,
# the engine from 0: rotary embeddings see only the distance between two positions, the same either way.)
PROMPT_SEES_ITSELF = ("paligemma",)


def is_vision_language(hf_config) -> bool:
    """A checkpoint of a vision-language model type the engine serves with images."""
    return hf_config.model_type in IMAGE_MODEL_TYPES


def load(model: str, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool, max_images: int,
         cache_bytes: int, loading: dict) -> tuple[torch.nn.Module, "ImageEncoder"]:
    """The checkpoint's language model as a causal LM with inflight's attention, and its image encoder
    (whose vision tower keeps transformers' own attention). `loading`: from_pretrained's further options
    (transformers' tensor-parallel plan sharding the language model; a quantized checkpoint's, quantization.py)."""
    full = AutoModelForImageTextToText.from_pretrained(
        model, dtype=dtype, trust_remote_code=trust_remote_code,
        attn_implementation={"text_config": attn_implementation, "vision_config": "sdpa"}, **loading).eval()
    text_config = full.config.text_config
    with torch.device("meta"):  # (its own weights are replaced at once by the checkpoint's)
        language_model = AutoModelForCausalLM.from_config(text_config, dtype=dtype)
    language_model.config = text_config
    language_model.model = full.get_decoder()
    language_model.lm_head = full.get_output_embeddings()
    if isinstance(language_model.lm_head.weight, DTensor):  # (tied to the embedding transformers' plan shards)
        language_model.lm_head = GatheredHead(language_model.lm_head)
    left = [name for name, p in language_model.named_parameters() if p.is_meta]
    if left:
        raise refuse(full.config.model_type, f"its language model could not be run alone ({left[0]} is not "
                                             "the checkpoint's)")
    # The language model's layers by their names in the whole checkpoint too, as a LoRA adapter trained on it
    # names them (model.language_model.layers.0.self_attn.q_proj): lora.py finds them so.
    own = {id(module) for module in language_model.modules()}
    language_model.checkpoint_module_names = {name: module for name, module in full.named_modules()
                                              if name and id(module) in own}
    processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    model_type = full.config.model_type
    spans = "images" if model_type in IMAGES_SEE_THEMSELVES else "prompt" if model_type in PROMPT_SEES_ITSELF else None
    encoder = ImageEncoder(full.model, processor, full.config.image_token_id, max_images, cache_bytes, spans=spans)
    return language_model.eval(), encoder


class GatheredHead(torch.nn.Module):
    """Under tensor parallelism, an output head whose weight is the input embedding's, which transformers'
    plan shards by vocabulary rows while the checkpoint's own plan leaves the head alone (Gemma 3's): each
    rank's logits of its rows, gathered."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        return F.linear(DTensor.from_local(hidden, weight.device_mesh, [Replicate()]), weight).full_tensor()


class VectorCache:
    """Recent prompts' image vectors by a digest of their pixels, least recently used first out, at most
    `capacity` bytes of vectors (0: none kept)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.size = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, key: bytes) -> torch.Tensor | None:
        vectors = self._entries.get(key)
        if vectors is not None:
            self._entries.move_to_end(key)
        return vectors

    def put(self, key: bytes, vectors: torch.Tensor) -> None:
        size = vectors.numel() * vectors.element_size()
        if size > self.capacity or key in self._entries:
            return
        self._entries[key] = vectors
        self.size += size
        while self.size > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self.size -= evicted.numel() * evicted.element_size()


def pixels_digest(pixels: dict) -> bytes:
    """A digest of the processor's pixel inputs (pixel values, image sizes, masks): the same digest, the same
    vision tower inputs, so the same vectors."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(pixels):
        value = pixels[name]
        if torch.is_tensor(value):
            digest.update(f"{name}{tuple(value.shape)}{value.dtype}".encode())
            digest.update(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(f"{name}{value!r}".encode())
    return digest.digest()


class ImageEncoder:
    def __init__(self, vision_language_model: torch.nn.Module, processor, image_token_id: int, max_images: int,
                 cache_bytes: int, spans: str | None = None):
        self.model = vision_language_model  # its get_image_features runs the vision tower and projector
        self.processor = processor
        self.image_token_id = image_token_id
        self.placeholder = processor.image_token  # (Gemma 3's: its start-of-image token, which the image follows)
        # Which tokens see each other: an image's ("images", IMAGES_SEE_THEMSELVES), the whole prompt's ("prompt",
        # PROMPT_SEES_ITSELF), or none (causal, None)
        self.spans = spans
        self.max_images = max_images
        self.cache = VectorCache(cache_bytes)
        self.images_encoded = 0  # images run through the vision tower
        self.images_cached = 0  # images whose vectors the cache held
        self._lock = threading.Lock()  # (one request's images at a time: a fast tokenizer is not thread-safe)

    def to(self, device: torch.device) -> "ImageEncoder":
        self.model.to(device)
        return self

    @torch.inference_mode()
    def prompt(self, text, images, first_virtual_id: int, check_length=None) -> dict:
        """The prompt of embeddings (prompt_embeds.py) of a text and its images: the vectors of its image
        tokens in order as the table, read by virtual ids from `first_virtual_id` (the model's vocab_size)
        up in the image tokens' places. `check_length(tokens)` may refuse the prompt once the processor has
        expanded its images, before the vision tower runs. ValueError naming what is wrong with the request."""
        if not isinstance(text, str) or not text:
            raise ValueError("a prompt with images needs its text, with a placeholder "
                             f"({self.placeholder}) where each image goes")
        if not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ValueError("multi_modal_data's image list is empty")
        if len(images) > self.max_images:
            raise ValueError(f"the prompt has {len(images)} images; this server takes at most {self.max_images} "
                             "(max_images_per_prompt)")
        placeholders = text.count(self.placeholder)
        if placeholders != len(images):
            raise ValueError(f"the prompt has {placeholders} image placeholders ({self.placeholder}) for "
                             f"{len(images)} images: give one placeholder where each image goes")
        pictures = [_picture(k, image) for k, image in enumerate(images)]
        with self._lock:
            inputs = self.processor(text=text, images=pictures, return_tensors="pt")
            token_ids = inputs.pop("input_ids")[0].tolist()
            if check_length is not None:
                check_length(len(token_ids))
            unused = ("attention_mask", "token_type_ids", "labels", *getattr(self.processor, "unused_input_names", ()))
            pixels = {name: value for name, value in inputs.items() if name not in unused}
            key = pixels_digest(pixels)
            vectors = self.cache.get(key)
            if vectors is None:
                vectors = self._vectors(pixels)
                self.cache.put(key, vectors)
                self.images_encoded += len(pictures)
            else:
                self.images_cached += len(pictures)
        if token_ids.count(self.image_token_id) != len(vectors):  # (the processor and the model disagree)
            raise ValueError(f"the images made {len(vectors)} vectors for {token_ids.count(self.image_token_id)} "
                             "image tokens of the prompt")
        rows = iter(range(first_virtual_id, first_virtual_id + len(vectors)))
        return {"prompt_token_ids": [next(rows) if t == self.image_token_id else t for t in token_ids],
                "prompt_embedding_table": vectors}

    def _vectors(self, pixels: dict) -> torch.Tensor:
        """The vision tower's and projector's vectors of the images' tokens, in order [tokens, hidden], on the CPU."""
        device = self.model.device
        pixels = {name: value.to(device) if torch.is_tensor(value) else value for name, value in pixels.items()}
        pixels["pixel_values"] = pixels["pixel_values"].to(self.model.dtype)
        features = self.model.get_image_features(**pixels, return_dict=True).pooler_output
        return torch.cat(list(features)).reshape(-1, features[0].shape[-1]).to("cpu")


def _picture(index: int, image):
    """An RGB PIL image from a PIL image or an encoded file's bytes (PNG, JPEG, ...)."""
    from PIL import Image  # (only where images are served: the engine does not need Pillow otherwise)

    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            with warnings.catch_warnings():  # a decompression bomb is refused, never decoded
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(image))
                image.load()
        except Image.UnidentifiedImageError:
            raise ValueError(f"image {index} could not be read: not an image file Pillow reads (PNG, JPEG, WebP, "
                             "GIF, ...)") from None
        except Exception as e:  # (any: Pillow's decoders raise OSError, ValueError, SyntaxError, ... on bad bytes)
            raise ValueError(f"image {index} could not be read: {type(e).__name__}: {e}") from None
    elif not isinstance(image, Image.Image):
        raise ValueError(f"image {index} must be a PIL image or an image file's bytes, got {type(image).__name__}")
    return image.convert("RGB")
