"""The offline tasks the zoo's pipelines must learn (see DESIGN.md)."""
import numpy as np

LETTERS = "abcdefghijklmnop"
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220),
           "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")


def reversal_examples(n: int, seed: int, length: int = 8) -> list[dict]:
    """``src`` 8 random letters, ``tgt`` the same reversed (space-separated)."""
    words = np.random.default_rng(seed).choice(list(LETTERS), (n, length))
    return [{"src": " ".join(w), "tgt": " ".join(w[::-1])} for w in words]


def shape_image(colour: str, shape: str, rng) -> np.ndarray:
    """A 32x32 RGB image: one ``colour`` ``shape`` at a random place and size, on noise."""
    yy, xx = np.mgrid[:32, :32]
    cx, cy = rng.integers(10, 22, 2)
    r = rng.integers(6, 10)
    if shape == "circle":
        inside = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    elif shape == "square":
        inside = (np.abs(xx - cx) <= 0.8 * r) & (np.abs(yy - cy) <= 0.8 * r)
    else:
        inside = (yy >= cy - r) & (yy <= cy + r) & (np.abs(xx - cx) <= (yy - cy + r) / 2)
    image = rng.integers(0, 40, (32, 32, 3))
    image[inside] = COLOURS[colour]
    return image.astype(np.uint8)


def shape_examples(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        out.append({"image": shape_image(colour, shape, rng), "caption": f"{colour} {shape}"})
    return out
