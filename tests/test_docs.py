"""Every sample of the README and docs/*.md runs and prints what the document shows (tests/_docs.py says how a
sample is found and compared); ``python tests/_docs.py --write`` refreshes them from their commands."""

from __future__ import annotations

import shutil

import pytest
from _docs import DOCS, mismatch, samples, scratch

pytest.importorskip("torch")  # the torch samples need it; make test installs it


@pytest.mark.parametrize("doc", [d for d in DOCS if samples(d)], ids=lambda d: d.name)
def test_the_samples_print_what_the_document_shows(doc, tmp_path):
    run = scratch(tmp_path)
    problems = []
    for sample in samples(doc):
        if sample.needs_nvcc and shutil.which("nvcc") is None:
            continue
        code, actual = run.execute(sample)
        if sample.python and code != 0:
            problems.append(f"{sample}: exit {code}: {' | '.join(actual[-3:])}")
            continue
        if any("Traceback" in line for line in actual) and not any("Traceback" in line for line in sample.output):
            problems.append(f"{sample}: a traceback: {' | '.join(actual[-3:])}")
            continue
        why = mismatch(sample, actual)
        if why is not None:
            problems.append(f"{sample}: {why}")
    assert not problems, "\n".join(problems)
