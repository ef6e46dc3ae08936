"""Administration commands of the ``tokenbus`` CLI: API keys and limits, usage reports."""
