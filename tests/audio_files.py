"""Audio files for tests, made with PyAV from the speech fixtures (what clients really upload)."""

from __future__ import annotations

import av


def encode(src, dst, container: str, codec: str, rate: int, layout: str = "stereo") -> None:
    """Re-encode `src` into `dst` with another container, codec, sample rate and channel layout."""
    with av.open(str(dst), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = layout
        resampler = av.AudioResampler(format=stream.format.name, layout=layout, rate=rate)
        with av.open(str(src)) as source:
            frames = [*source.decode(audio=0), None]
        for frame in frames:
            for converted in resampler.resample(frame):
                out.mux(stream.encode(converted))
        out.mux(stream.encode(None))
