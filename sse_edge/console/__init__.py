"""The web console's files (``/console``): one page, its script and its style, plain HTML, JS and
CSS with no build step. The page talks only to the public API with the key the user pastes,
which stays in the browser tab's session storage. sse_edge/api/console.py serves them."""

from pathlib import Path

ASSETS = Path(__file__).parent
