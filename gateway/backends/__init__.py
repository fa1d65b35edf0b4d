"""The vLLM backends: scraping their /metrics and parsing what vLLM reports."""
