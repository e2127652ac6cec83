"""LoRA: low-rank adapters on a frozen base model, through peft (model.lora).

The learner trains only the adapters (its optimizer holds their state alone), its KL
reference is the same model computing its base (the adapters scaled to 0; no second
copy), and the weight sync sends only the adapters: the actors' torch engine wraps its
copy of the base in the same adapters and receives them in place. final/ is a peft
adapter directory. docs/lora.md.
"""
