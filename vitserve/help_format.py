"""The help formatter of every `vitserve` command: argparse's defaults shown, without "(default: None)" and without
a second default after a help text that already says its own."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or "default" in help_text:
            return help_text
        return super()._get_help_string(action) or help_text  # typeshed's `str | None`: argparse returns a str
