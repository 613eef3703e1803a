"""The API process of a supervised `tidal serve` never imports torch: the engine process holds the model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Builds what `tidal serve` builds in the API process for the supervised engine (the client, the
# tokenizer and chat template it loads, the app), serves a tokenize and a chat render, scrapes
# /metrics, and stops short of spawning the engine process.
_SCRIPT = textwrap.dedent(
    """
    import sys

    from starlette.testclient import TestClient

    import tidal.cli_serve
    from tidal.client.supervised import SupervisedEngineClient, load_api_tokenizer
    from tidal.config.engine import TidalConfig
    from tidal.server.app import build_app
    from tidal.server.inputs import PromptLimits
    from tidal.server.metrics import ServerMetrics
    from tidal.server.state import ServerState

    cfg = TidalConfig()
    engine = SupervisedEngineClient(cfg.engine)  # the bundled GGUF: its tokenizer is the real one
    engine.tokenizer = load_api_tokenizer(engine.model_path)
    state = ServerState(
        engine=engine,
        config=cfg,
        metrics=ServerMetrics(),
        served_name="m",
        model_root=engine.model_path,
        limits=PromptLimits.of(cfg.engine.limits, 2048, 262144),
    )
    app = build_app(state)
    engine.start = lambda: None  # no engine process: the lifespan would spawn one
    engine.shutdown = lambda: _none()

    async def _none():
        return None

    with TestClient(app) as http:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True}
        assert http.post("/tokenize", json=chat).json()["count"] > 2
        assert http.post("/tokenize", json={"prompt": "Hello"}).json()["count"] >= 1
        assert b"tidal:" in http.get("/metrics").content
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print("TORCH_MODULES", loaded)
    print("TOKENIZER", type(engine.tokenizer).__name__, "NUMPY", "numpy" in sys.modules)
    """
)


def test_the_supervised_api_process_does_not_import_torch() -> None:
    """Nor numpy (~15 MiB) where the compact tokenizer serves: the architecture is read from
    the header without it. (The first start builds that tokenizer, from the full one, which
    needs numpy; here a first run builds and caches it and the second one is measured.)"""
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "TORCH_MODULES []" in proc.stdout, proc.stdout[-2000:]
    if "TOKENIZER CompactTokenizer" in proc.stdout:
        assert "NUMPY False" in proc.stdout, proc.stdout[-2000:]
