"""The request traces and length distributions bundled with the twin, by the names scenarios use
(``arrivals.trace`` and ``lengths.source``).  Both ``twin.scenario`` (to name them in errors) and
``twin.workload`` (to read them) need these tables, so they live apart from either."""
from twin.paths import DATA_DIR

#: ``arrivals.trace`` names of the bundled request traces (any other value is a CSV path)
TRACES = {
    "azure-code": DATA_DIR / "traces" / "AzureLLMInferenceTrace_code.csv",
    "azure-conv": DATA_DIR / "traces" / "AzureLLMInferenceTrace_conv.csv",
    "mooncake-conversation": DATA_DIR / "traces" / "mooncake_conversation_trace.csv",
    "mooncake-synthetic": DATA_DIR / "traces" / "mooncake_synthetic_trace.csv",
}
#: ``lengths.source`` values sampled from a bundled file of (prompt, output) token counts
LENGTH_FILES = {
    "sharegpt-8k": DATA_DIR / "lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": DATA_DIR / "lengths" / "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}
