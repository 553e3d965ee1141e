"""What the heads learn from: conversations (ShareGPT's training split or a JSONL file), the target's regenerated
replies, token sequences, their mix, and the target's labels; a recipe's first stages (prepare.recipe_data)."""
