"""Text in and out: the tokenizer, grammar masks for structured output, chat templates."""
