"""The demo VLM's vision tower: a SigLIP-style encoder whose lower layers are wired by hand.

Why by hand: a vision transformer of this size trained from scratch did not learn shape under
varying size and position in the few CPU minutes a demo build may take (measured on 2 cores: colour
at once, shape ~45% right after 6 minutes, where a small CNN reached 94% - but idefics3 has no
convolutions beyond the patch embedding). So the lower layers
compute, exactly and for any size, position and rotation, what separates the four shapes and
colours; only the classifier on top is trained (vlm_train.fit_readout). Per 8x8-pixel patch token:

  layer 0  chroma of every pixel (colour-opponent a = R-G, b = (R+G)/2-B from the patch embedding),
           |a|+|b|, and four thresholded colour sums
  layer 1  a soft silhouette mask per pixel (neutral backgrounds have no chroma) and its area
  layer 2  attention fetches the border pixels of the neighbouring patches; the MLP sums |mask
           differences| over neighbour pairs in 4 directions: the silhouette's perimeter
  layer 3  attention averages area, perimeters and colour over the image; the MLP is the trained
           classifier (compactness perimeter^2/area tells circle < square < triangle < star)
  layer 4  compares the classifier's colour logits pairwise, and its shape logits: 0/1 "c beats c'"
  layer 5  ANDs "colour c beats the other three", "shape s beats the other three" and the token's
           output group j into one of 64 features: the argmax class, per output token
The connector maps feature (colour, shape, group j) to image token j's tuned embedding.

LayerNorms stay (nearly) linear: two anchor dimensions (+C, -C) dominate every token's variance,
and each read-out weight row sums to zero (through an always-zero dimension), so the mean cancels.
"""

from __future__ import annotations

import math

import numpy as np

IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 64, 8, 4
GRID = IMAGE_SIZE // PATCH_SIZE  # 8x8 patch tokens
PIXELS = PATCH_SIZE * PATCH_SIZE
HIDDEN, INTERMEDIATE, LAYERS, HEADS = 448, 512, 6, 7
HEAD_DIM = HIDDEN // HEADS
READOUT_FEATURES, READOUT_HIDDEN, READOUT_OUTPUTS = 7, 64, 8  # pooled features -> 4 colour + 4 shape logits
_ANCHOR = 1000.0
_SIGMA = _ANCHOR * math.sqrt(2 / HIDDEN)  # a token's LayerNorm std, set by the anchors
_CHROMA_SLOPE, _COLOUR_THRESHOLD = 8.0, 0.3
_MASK_THRESHOLD, _MASK_SLOPE, _EDGE_SLOPE = 0.45, 12.0, 10.0
# (dy, dx, weight): near-isotropic weights for a perimeter counted over 8-neighbour pixel pairs
_DIRECTIONS = ((0, 1, 0.948), (1, 0, 0.948), (1, 1, 0.670), (1, -1, 0.670))
_ATTENTION_SHARPNESS = 560.0  # neighbour fetch: the next-best patch gets ~1e-9 of the weight
_INDICATOR_SLOPE, _AND_SLOPE = 4.0, 8.0


class _Dims:
    """Where each quantity lives in a token's residual vector."""

    ZERO, PLUS, MINUS = 0, 1, 2
    COL_COS, COL_SIN, ROW_COS, ROW_SIN = 3, 4, 5, 6
    GROUP = 7  # 4: one-hot output token the patch belongs to (pixel shuffle 4x4 -> 1)
    A = 11  # 64 per-pixel chroma a
    B = A + PIXELS  # 64 per-pixel chroma b
    U = B + PIXELS  # 64 per-pixel |a|+|b|
    MASK = U + PIXELS  # 64 per-pixel silhouette
    FETCH = MASK + PIXELS  # right col 0 (8), left col 7 (8), below row 0 (8), below-right, below-left
    FEATURES = FETCH + 26  # area, perimeter along the axes, perimeter along the diagonals, 4 colour sums
    POOLED = FEATURES + READOUT_FEATURES  # the same, averaged over the image
    LOGITS = POOLED + READOUT_FEATURES  # 8 classifier outputs
    BEATS = LOGITS + READOUT_OUTPUTS  # 24: 0/1 per ordered pair of colours (12), then of shapes (12)
    OUT = BEATS + 24  # 64: (colour, shape, group)
    END = OUT + 64


assert _Dims.END <= HIDDEN
POOLED_FEATURES = slice(_Dims.POOLED, _Dims.POOLED + READOUT_FEATURES)
"""Where layer 3's attention leaves the image-level classifier inputs in every token."""


def vision_config() -> dict:
    """The idefics3 vision_config of this tower."""
    return {"model_type": "idefics3_vision", "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
            "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "patch_size": PATCH_SIZE,
            "image_size": IMAGE_SIZE, "num_channels": 3, "layer_norm_eps": 1e-6}


def _read(coefficients: dict[int, float]) -> np.ndarray:
    """A weight row reading sum(coef * x[dim]) from a LayerNorm output: the token mean cancels out."""
    row = np.zeros(HIDDEN, np.float32)
    for dim, coefficient in coefficients.items():
        row[dim] += coefficient
    row[_Dims.ZERO] -= row.sum()
    return row


class _Mlp:
    """Builds one layer's fc1/fc2 unit by unit."""

    def __init__(self):
        self.fc1 = np.zeros((INTERMEDIATE, HIDDEN), np.float32)
        self.b1 = np.zeros(INTERMEDIATE, np.float32)
        self.fc2 = np.zeros((HIDDEN, INTERMEDIATE), np.float32)
        self.b2 = np.zeros(HIDDEN, np.float32)
        self.units = 0

    def unit(self, reads: dict[int, float], bias: float, writes: dict[int, float]) -> None:
        """Add GELU(reads . x + bias), added to the residual with the weights in `writes`."""
        self.fc1[self.units], self.b1[self.units] = _read(reads), bias
        for dim, weight in writes.items():
            self.fc2[dim, self.units] += weight
        self.units += 1

    def saturate(self, reads: dict[int, float], bias: float, writes: dict[int, float]) -> None:
        """Add clip(reads . x + bias, 0, 1), softly: GELU(z) - GELU(z - 1)."""
        self.unit(reads, bias, writes)
        self.unit(reads, bias - 1, {dim: -weight for dim, weight in writes.items()})


def wire(readout: dict[str, np.ndarray] | None = None,
         prompts: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """All vision_model.* and connector.* weights; the classifier and connector are zero until given."""
    weights = {**_embeddings(), "vision_model.post_layernorm.weight": np.full(HIDDEN, _SIGMA, np.float32),
               "vision_model.post_layernorm.bias": np.zeros(HIDDEN, np.float32)}
    mlps = [_chroma(), _silhouette(), _perimeter(), _classifier(readout), _indicators(), _and_gate()]
    attentions = {2: _fetch_attention(), 3: _pool_attention()}
    for layer, mlp in enumerate(mlps):
        prefix = f"vision_model.encoder.layers.{layer}"
        for norm in ("layer_norm1", "layer_norm2"):
            weights[f"{prefix}.{norm}.weight"] = np.full(HIDDEN, _SIGMA, np.float32)
            weights[f"{prefix}.{norm}.bias"] = np.zeros(HIDDEN, np.float32)
        for name, value in attentions.get(layer, _no_attention()).items():
            weights[f"{prefix}.self_attn.{name}"] = value
        weights.update({f"{prefix}.mlp.fc1.weight": mlp.fc1, f"{prefix}.mlp.fc1.bias": mlp.b1,
                        f"{prefix}.mlp.fc2.weight": mlp.fc2, f"{prefix}.mlp.fc2.bias": mlp.b2})
    weights["connector.modality_projection.proj.weight"] = _connector(prompts)
    return weights


def _embeddings() -> dict[str, np.ndarray]:
    """Patch embedding: per-pixel chroma a and b, plus the anchors; position: row/column code and group."""
    conv = np.zeros((HIDDEN, PATCH_SIZE, PATCH_SIZE, 3), np.float32)
    for q in range(PIXELS):
        y, x = divmod(q, PATCH_SIZE)
        conv[_Dims.A + q, y, x] = (1, -1, 0)
        conv[_Dims.B + q, y, x] = (0.5, 0.5, -1)
    bias = np.zeros(HIDDEN, np.float32)
    bias[_Dims.PLUS], bias[_Dims.MINUS] = _ANCHOR, -_ANCHOR
    position = np.zeros((GRID * GRID, HIDDEN), np.float32)
    for token in range(GRID * GRID):
        row, col = divmod(token, GRID)
        position[token, _Dims.COL_COS:_Dims.ROW_SIN + 1] = [math.cos(2 * math.pi * col / GRID),
                                                            math.sin(2 * math.pi * col / GRID),
                                                            math.cos(2 * math.pi * row / GRID),
                                                            math.sin(2 * math.pi * row / GRID)]
        block = GRID // SCALE_FACTOR
        position[token, _Dims.GROUP + (row // SCALE_FACTOR) * block + col // SCALE_FACTOR] = 1
    return {"vision_model.embeddings.patch_embedding.weight": conv,
            "vision_model.embeddings.patch_embedding.bias": bias,
            "vision_model.embeddings.position_embedding.weight": position}


def _chroma() -> _Mlp:
    """Layer 0: u = |a| + |b| per pixel (soft: x * erf(s x / sqrt 2)), and thresholded colour sums."""
    mlp, s, t = _Mlp(), _CHROMA_SLOPE, _COLOUR_THRESHOLD
    for q in range(PIXELS):
        for dim in (_Dims.A + q, _Dims.B + q):
            for sign in (1, -1):  # GELU(sx) + GELU(-sx) = sx * erf(sx / sqrt 2)
                mlp.unit({dim: sign * s}, 0.0, {_Dims.U + q: 1 / s})
        for colour, (dim, sign) in enumerate(((_Dims.A, 1), (_Dims.A, -1), (_Dims.B, 1), (_Dims.B, -1))):
            mlp.unit({dim + q: sign * s}, -s * t, {_Dims.FEATURES + 3 + colour: 1 / (s * PIXELS)})
    return mlp


def _silhouette() -> _Mlp:
    """Layer 1: mask = clip(k (u - threshold), 0, 1) per pixel, and the patch's mean mask (area)."""
    mlp, k = _Mlp(), _MASK_SLOPE
    for q in range(PIXELS):
        writes = {_Dims.MASK + q: 1.0, _Dims.FEATURES: 1 / PIXELS}
        mlp.saturate({_Dims.U + q: k}, -k * _MASK_THRESHOLD, writes)
    return mlp


def _neighbour(y: int, x: int) -> int:
    """Residual dim holding the mask at pixel (y, x) of this patch, or a fetched pixel of a neighbour."""
    last = PATCH_SIZE
    if 0 <= y < last and 0 <= x < last:
        return _Dims.MASK + y * PATCH_SIZE + x
    if y < last and x == last:
        return _Dims.FETCH + y  # right neighbour, column 0
    if y < last and x == -1:
        return _Dims.FETCH + 8 + y  # left neighbour, column 7
    if 0 <= x < last:
        return _Dims.FETCH + 16 + x  # neighbour below, row 0
    return _Dims.FETCH + (24 if x == last else 25)  # below-right (0, 0) or below-left (0, 7)


def _perimeter() -> _Mlp:
    """Layer 2: sums of weighted |mask(p) - mask(p + d)| (soft abs, as in layer 0), along the axes and
    along the diagonals apart: their ratio tells a straight edge's direction, so the classifier can
    correct the perimeter of a square for its rotation."""
    mlp, s = _Mlp(), _EDGE_SLOPE
    for q in range(PIXELS):
        y, x = divmod(q, PATCH_SIZE)
        for dy, dx, weight in _DIRECTIONS:
            other = _neighbour(y + dy, x + dx)
            for sign in (1, -1):
                feature = _Dims.FEATURES + (1 if dy == 0 or dx == 0 else 2)
                mlp.unit({_Dims.MASK + q: sign * s, other: -sign * s}, 0.0,
                         {feature: weight / (s * PIXELS) * 4})  # x4: keeps it near 1
    return mlp


def _no_attention() -> dict[str, np.ndarray]:
    """An attention block that adds nothing."""
    zeros = {f"{p}_proj.weight": np.zeros((HIDDEN, HIDDEN), np.float32) for p in ("q", "k", "v", "out")}
    return {**zeros, **{f"{p}_proj.bias": np.zeros(HIDDEN, np.float32) for p in ("q", "k", "v", "out")}}


def _fetch_attention() -> dict[str, np.ndarray]:
    """Layer 2 attention: head h reads border pixels of the patch at offset (dr, dc) (wrapping around)."""
    weights = _no_attention()
    q, k, v, out = (weights[f"{p}_proj.weight"] for p in ("q", "k", "v", "out"))
    fetches = [((0, 1), [y * 8 for y in range(8)]), ((0, -1), [y * 8 + 7 for y in range(8)]),
               ((1, 0), list(range(8))), ((1, 1), [0]), ((1, -1), [7])]
    slot = 0
    for head, ((dr, dc), pixels) in enumerate(fetches):
        base = head * HEAD_DIM
        for i, (cos_dim, sin_dim, delta) in enumerate(((_Dims.COL_COS, _Dims.COL_SIN, dc),
                                                       (_Dims.ROW_COS, _Dims.ROW_SIN, dr))):
            angle = 2 * math.pi * delta / GRID  # query = own position code rotated by the offset
            scale = _ATTENTION_SHARPNESS
            q[base + 2 * i] = _read({cos_dim: scale * math.cos(angle), sin_dim: -scale * math.sin(angle)})
            q[base + 2 * i + 1] = _read({cos_dim: scale * math.sin(angle), sin_dim: scale * math.cos(angle)})
            k[base + 2 * i], k[base + 2 * i + 1] = _read({cos_dim: 1.0}), _read({sin_dim: 1.0})
        for i, pixel in enumerate(pixels):
            v[base + i] = _read({_Dims.MASK + pixel: 1.0})
            out[_Dims.FETCH + slot, base + i] = 1.0
            slot += 1
    return weights


def _pool_attention() -> dict[str, np.ndarray]:
    """Layer 3 attention: one head with equal weights everywhere copies the image mean of the features."""
    weights = _no_attention()
    for i in range(READOUT_FEATURES):
        weights["v_proj.weight"][i] = _read({_Dims.FEATURES + i: 1.0})
        weights["out_proj.weight"][_Dims.POOLED + i, i] = 1.0
    return weights


def _classifier(readout: dict[str, np.ndarray] | None) -> _Mlp:
    """Layer 3 MLP: the trained classifier (standardize -> GELU hidden -> 8 logits), or nothing yet."""
    mlp = _Mlp()
    if readout is None:
        return mlp
    mean, std = readout["mean"], readout["std"]
    for u in range(READOUT_HIDDEN):
        w = readout["w1"][u] / std
        writes = {_Dims.LOGITS + o: float(readout["w2"][o, u]) for o in range(READOUT_OUTPUTS)}
        mlp.unit({_Dims.POOLED + i: float(w[i]) for i in range(READOUT_FEATURES)},
                 float(readout["b1"][u] - w @ mean), writes)
    mlp.b2[_Dims.LOGITS:_Dims.LOGITS + READOUT_OUTPUTS] = readout["b2"]
    return mlp


def _pairs() -> list[tuple[int, int]]:
    """Ordered pairs (winner, loser) of the 4 colour logits, then of the 4 shape logits (indices 0..7)."""
    return [(group + a, group + b) for group in (0, 4) for a in range(4) for b in range(4) if a != b]


def _indicators() -> _Mlp:
    """Layer 4: "logit a beats logit b" = clip(k (a - b), 0, 1) for every ordered pair in a group."""
    mlp = _Mlp()
    for i, (a, b) in enumerate(_pairs()):
        reads = {_Dims.LOGITS + a: _INDICATOR_SLOPE, _Dims.LOGITS + b: -_INDICATOR_SLOPE}
        mlp.saturate(reads, 0.0, {_Dims.BEATS + i: 1.0})
    return mlp


def _and_gate() -> _Mlp:
    """Layer 5: feature (c, s, j) = colour c beats all, shape s beats all, and the token is in group j."""
    mlp, k, pairs = _Mlp(), _AND_SLOPE, _pairs()
    for c in range(4):
        for s in range(4):
            wins = [i for i, (a, _) in enumerate(pairs) if a in (c, 4 + s)]  # 3 + 3 comparisons
            for j in range(4):
                reads = {**{_Dims.BEATS + i: k for i in wins}, _Dims.GROUP + j: k}
                mlp.saturate(reads, -6.5 * k, {_Dims.OUT + (c * 4 + s) * 4 + j: 1.0})
    return mlp


def _connector(prompts: np.ndarray | None) -> np.ndarray:
    """Connector: from the first patch of each output group, feature (c, s, j) -> prompts[c * 4 + s, j]."""
    tokens_in = SCALE_FACTOR * SCALE_FACTOR
    projection = np.zeros((prompts.shape[-1] if prompts is not None else 576, HIDDEN * tokens_in), np.float32)
    if prompts is None:
        return projection
    for label in range(16):
        for j in range(4):
            projection[:, _Dims.OUT + label * 4 + j] = prompts[label, j]
    projection[:, _Dims.ZERO] = -projection[:, :HIDDEN].sum(axis=1)  # the mean cancels (see _read)
    return projection
