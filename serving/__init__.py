"""The torch-free HTTP serving kit both processes (gateway, engine) run on. It imports neither of them."""
