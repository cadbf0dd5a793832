"""Synthetic images of one coloured shape (4 shapes x 4 colours) and the words that name them.

The demo vision-language model (workers/demo/vlm_build.py) is trained and tested on these. Every
image comes from a numpy Generator, so one seed always gives the same images (byte for byte as PNG).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (215, 35, 35), "green": (40, 165, 60), "blue": (35, 75, 215), "yellow": (240, 210, 30)}
"""Colour words and their base RGB (each image jitters it a little)."""

SHAPES = ("circle", "square", "triangle", "star")
"""Shape words, in label order."""

CLASSES = tuple((colour, shape) for colour in COLOURS for shape in SHAPES)
"""All 16 (colour, shape) labels; an image's class index is its position here."""

# Neutral light and dark backgrounds (nearly no chroma): none of them reads as red, green, blue or yellow.
BACKGROUNDS = ((250, 250, 250), (222, 222, 222), (244, 240, 230), (224, 222, 230),
               (20, 20, 20), (62, 62, 62), (44, 38, 36), (36, 40, 44))
_SUPERSAMPLE = 4  # draw 4x larger, then downsample: smooth edges like a real picture
RADIUS = (0.16, 0.40)  # circumradius range, as a fraction of the image side
NOISE_SHARE = 0.3  # share of images with sensor-like noise
ROTATION = 180.0  # the largest rotation in degrees, either way, from the upright shape
OFFSET = 1.0  # how far the centre may move from the image centre, as a share of the room the shape leaves


@dataclass(frozen=True)
class Sample:
    """One generated image with its label."""

    image: Image.Image
    colour: str
    shape: str

    @property
    def label(self) -> int:
        """Index of (colour, shape) in CLASSES."""
        return CLASSES.index((self.colour, self.shape))


def answer(colour: str, shape: str) -> str:
    """The answer the model is taught for one shape: "A red circle."."""
    return f"A {colour} {shape}."


def pair_answer(first: tuple[str, str], second: tuple[str, str]) -> str:
    """The answer the model is taught for two images: "A red circle and a blue star."."""
    return f"A {first[0]} {first[1]} and a {second[0]} {second[1]}."


def names_correctly(text: str, colour: str, shape: str) -> bool:
    """Whether `text` names this colour and shape and no other colour or shape (lowercase word match)."""
    words = set(_words(text))
    wrong = (set(COLOURS) - {colour}) | (set(SHAPES) - {shape})
    return colour in words and shape in words and not (words & wrong)


def _words(text: str) -> list[str]:
    cleaned = "".join(ch if ch.isalpha() else " " for ch in text.lower())
    # Plurals count as the word ("circles" names a circle).
    return [w[:-1] if w.endswith("s") and w[:-1] in SHAPES else w for w in cleaned.split()]


def render(colour: str, shape: str, rng: np.random.Generator, size: int = 64) -> Image.Image:
    """One RGB image of a `colour` `shape` at a random size, place and rotation, on a random background."""
    big = size * _SUPERSAMPLE
    background = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    image = Image.new("RGB", (big, big), background)
    radius = big * rng.uniform(*RADIUS)  # circumradius; the shape always fits inside the image
    room = (big / 2 - radius - 2) * OFFSET
    cx, cy = (big / 2 + rng.uniform(-room, room) for _ in range(2))
    angle = math.radians(rng.uniform(-ROTATION, ROTATION))
    fill = tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in COLOURS[colour])
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=fill)
    else:
        draw.polygon(_polygon(shape, cx, cy, radius, angle), fill=fill)
    image = image.resize((size, size), Image.Resampling.LANCZOS)
    if rng.random() < NOISE_SHARE:  # some images get sensor-like noise
        pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, rng.uniform(2, 6), (size, size, 3))
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return image


def _polygon(shape: str, cx: float, cy: float, radius: float, angle: float) -> list[tuple[float, float]]:
    """Vertices of a square, triangle or five-pointed star around (cx, cy), turned `angle` from upright."""
    angle += -math.pi / 4 if shape == "square" else -math.pi / 2  # angle 0: flat-bottomed, point up
    if shape == "star":
        corners = [(radius if i % 2 == 0 else radius * 0.42, angle + i * math.pi / 5) for i in range(10)]
    else:
        n = {"square": 4, "triangle": 3}[shape]
        corners = [(radius, angle + i * 2 * math.pi / n) for i in range(n)]
    return [(cx + r * math.cos(a), cy + r * math.sin(a)) for r, a in corners]


def samples(seed: int, count: int, size: int = 64) -> list[Sample]:
    """`count` images, every class equally often (in shuffled order), fully determined by `seed`."""
    rng = np.random.default_rng(seed)
    labels = np.resize(np.arange(len(CLASSES)), count)
    rng.shuffle(labels)
    return [Sample(render(*CLASSES[i], rng, size), *CLASSES[i]) for i in labels]


def pixel_batch(images: list[Image.Image]) -> np.ndarray:
    """Images as the idefics3 processor feeds them (x/255 - 0.5) / 0.5, channels last: (N, H, W, 3)."""
    pixels = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) for im in images])
    return (pixels / 255.0 - 0.5) / 0.5
