"""The request-wide check for lone surrogates (``server/fields.py``; ``server/protocol.py``
before session 48), an earlier version against this tree's, alternating in one process:
milliseconds per body, best of nine.

    git show 91ed7ca:src/llmserve/server/protocol.py > /tmp/old_protocol.py
    .venv/bin/python benchmarks/surrogate_check_ab.py /tmp/old_protocol.py
"""

import importlib.util
import sys
import timeit

from llmserve.server import fields as new

spec = importlib.util.spec_from_file_location("old_protocol", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
bodies = {"2M token ids": {"prompt": list(range(2_000_000))},
          "200k token ids": {"prompt": list(range(200_000))},
          "4 MB ASCII prompt": {"prompt": "x" * 4_000_000},
          "chat, 50 messages": {"messages": [{"role": "user", "content": "hello " * 50}] * 50}}
print("| body | before ms | after ms |\n|---|---|---|")
for name, body in bodies.items():
    times = {"before": [], "after": []}
    for _ in range(3):
        for label, mod in (("before", old), ("after", new)):
            check = getattr(mod, "no_lone_surrogates", None) or mod._no_lone_surrogates
            times[label].append(min(timeit.repeat(lambda c=check, b=body: c(b),
                                                  number=1, repeat=3)) * 1e3)
    print(f"| {name} | {min(times['before']):.2f} | {min(times['after']):.2f} |")
