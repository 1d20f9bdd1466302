"""World models: a latent model of a task's dynamics, reward and success, trained from datasets and rollouts."""
