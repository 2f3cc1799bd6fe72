"""What a classifier's exit ramps would save on texts from a file, thresholds tuned in hindsight on those texts at
Apparate's 99 % constraint: each ramp's agreement with the model, the share of the model's time saved, the
agreement kept, and the share of texts released at each ramp. To compare ramps artifacts on the same held-out texts.

    python -m academus.loadgen.probes.ramp_saving --artifacts A --model NAME --texts F.jsonl [--limit N]

NAME: a user's classifier (or a head on a user's model) with ramps (`academus ramps train --model NAME`), or a
bundled task (sentiment, spam). The savings per ramp are the artifact's, measured when the ramps were trained.
The last line printed is the JSON.
"""

from __future__ import annotations

import json

from academus.loadgen.probes import texts_probe_args
from academus.shared.training.ramps import CONSTRAINT, Subject, hindsight_tuning, ramps_pass


def main(argv: list[str] | None = None) -> int:
    args, texts = texts_probe_args(__doc__, "a user's classifier with ramps, or a bundled task", argv)
    ramps, manifest, states, final = ramps_pass(args.artifacts, Subject.named(args.artifacts, args.model), texts)
    savings = {int(k): float(v) for k, v in manifest.extra["saving"].items()}
    _, agree, tuning = hindsight_tuning(ramps, states, final, savings)
    print(json.dumps({"model": args.model, "texts": len(texts), "source": str(args.texts),
                      "ramp_agreement": {str(k): round(float(agree[:, j].mean()), 4)
                                         for j, k in enumerate(ramps.layers)},
                      "constraint": CONSTRAINT, "saving": round(tuning.saving, 4),
                      "agreement": round(tuning.agreement, 4),
                      "released": {str(k): round(r, 4) for k, r in zip(ramps.layers, tuning.exit_rates, strict=True)},
                      "thresholds": [round(t, 4) for t in tuning.thresholds]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
