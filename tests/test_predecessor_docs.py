"""docs/predecessor.md stays in step with the code: every predecessor key the loaders accept or
refuse, and every name of the drop-in, is in its tables."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import msprobe_engine.compat as compat
import msprobe_engine.compat.mindspore as compat_mindspore
from msprobe_engine.config.legacy import LEGACY_KEYS, LEGACY_OPS
from msprobe_engine.dump.config import OTHER_TASKS, PREDECESSOR_ONLY, PREDECESSOR_SECTION_ONLY
from msprobe_engine.dump.task import DUMP_TASKS

DOC = (Path(__file__).resolve().parents[1] / "docs" / "predecessor.md").read_text(encoding="utf-8")
NAMES = sorted({*PREDECESSOR_ONLY, *PREDECESSOR_SECTION_ONLY, *DUMP_TASKS.names(), *OTHER_TASKS, *LEGACY_KEYS,
                *LEGACY_OPS, *compat.__all__, *compat_mindspore.__all__,
                *compat_mindspore.NOT_PROVIDED})


@pytest.mark.parametrize("name", NAMES)
def test_every_key_and_call_is_documented(name):
    assert re.search(rf"`[^`\n]*\b{re.escape(name)}\b[^`\n]*`", DOC), \
        f"docs/predecessor.md does not mention {name!r}"
