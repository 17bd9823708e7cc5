"""Training data: text and conversations drawn from the task domains, the tokenizer trained on
them, and the tokenized sets each stage reads."""
