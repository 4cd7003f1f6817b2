"""Draw the bundled sample picture: a tortoiseshell cat on a wooden floor (after the paper's
image experiment, PAPER.md section 6), made here so it can be shipped (CC0, see resources/
LICENSE-sample.txt).

    python packaging/make_sample_image.py

Writes resources/sample.png (deterministic: a fixed seed for the fur's patches).
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

OUT = Path(__file__).resolve().parents[1] / "resources" / "sample.png"
W, H = 384, 288


def floor(d: ImageDraw.ImageDraw, rng: random.Random) -> None:
    plank = 36
    for i, y in enumerate(range(0, H, plank)):
        shade = (150 + 12 * (i % 3), 98 + 8 * (i % 2), 56)
        d.rectangle([0, y, W, y + plank - 2], fill=shade)
        d.line([0, y + plank - 1, W, y + plank - 1], fill=(90, 58, 32), width=2)
        seam = rng.randrange(40, W - 40)
        d.line([seam, y, seam, y + plank - 2], fill=(100, 64, 36), width=2)
        for _ in range(5):  # grain
            gy = y + rng.randrange(4, plank - 6)
            x0 = rng.randrange(0, W - 80)
            d.arc([x0, gy - 3, x0 + rng.randrange(60, 140), gy + 3], 0, 180, fill=(125, 80, 44))


def cat(img: Image.Image, rng: random.Random) -> None:
    fur = Image.new("RGBA", (W, H), (0, 0, 0, 0))
    d = ImageDraw.Draw(fur)
    black, ginger, cream = (38, 30, 28, 255), (196, 110, 42, 255), (226, 180, 120, 255)
    d.ellipse([110, 140, 290, 250], fill=black)  # body
    d.ellipse([72, 96, 170, 186], fill=black)  # head
    d.polygon([(80, 120), (86, 70), (118, 102)], fill=black)  # ears
    d.polygon([(124, 100), (156, 68), (162, 118)], fill=black)
    d.line([(286, 226), (330, 200), (352, 150), (340, 120)], fill=black, width=16, joint="curve")
    mask = fur.getchannel("A")
    blots = Image.new("RGBA", (W, H), (0, 0, 0, 0))
    b = ImageDraw.Draw(blots)
    for _ in range(38):  # the tortoiseshell's ginger and cream patches
        x, y, r = rng.randrange(70, 350), rng.randrange(70, 250), rng.randrange(6, 20)
        b.ellipse([x - r, y - r, x + r, y + r], fill=ginger if rng.random() < 0.65 else cream)
    blots = blots.filter(ImageFilter.GaussianBlur(2))
    fur.alpha_composite(Image.composite(blots, Image.new("RGBA", (W, H)), mask))
    img.alpha_composite(fur)
    e = ImageDraw.Draw(img)
    for x in (100, 134):  # eyes
        e.ellipse([x, 128, x + 14, 142], fill=(222, 196, 64))
        e.ellipse([x + 5, 129, x + 9, 141], fill=(20, 16, 12))
    e.polygon([(117, 152), (125, 152), (121, 158)], fill=(214, 140, 140))  # nose
    for dy in (-3, 3):  # whiskers
        e.line([(108, 156 + dy), (60, 150 + 3 * dy)], fill=(236, 230, 220), width=1)
        e.line([(134, 156 + dy), (180, 150 + 3 * dy)], fill=(236, 230, 220), width=1)


def main() -> None:
    rng = random.Random(2511)
    img = Image.new("RGBA", (W, H))
    floor(ImageDraw.Draw(img), rng)
    shadow = Image.new("RGBA", (W, H), (0, 0, 0, 0))
    ImageDraw.Draw(shadow).ellipse([100, 226, 310, 262], fill=(40, 24, 12, 110))
    img.alpha_composite(shadow.filter(ImageFilter.GaussianBlur(6)))
    cat(img, rng)
    img.convert("RGB").save(OUT, optimize=True)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
