"""Demo assets for elastictrain: a tiny character-level GPT and a packaged text corpus."""
