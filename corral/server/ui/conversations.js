// Conversations kept in the browser's localStorage: nothing of them goes to the daemon
// except the messages of the one being answered.
const KEY = "corral.conversations";

export class Conversations {
  constructor(storage) {
    this.storage = storage;
    let saved = [];
    try { saved = JSON.parse(storage.getItem(KEY) || "[]"); } catch (_) { saved = []; }
    this.list = Array.isArray(saved) ? saved : [];
    this.currentId = storage.getItem(`${KEY}.current`);
    if (!this.list.some((c) => c.id === this.currentId)) this.create();
  }

  all() { return [...this.list].sort((a, b) => b.updated - a.updated); }

  current() { return this.list.find((c) => c.id === this.currentId); }

  create() {
    const conversation = { id: `${Date.now()}-${Math.random().toString(36).slice(2, 8)}`,
      title: "", model: "", messages: [], updated: Date.now() };
    this.list.push(conversation);
    this.select(conversation.id);
    return conversation;
  }

  select(id) {
    this.currentId = id;
    this.storage.setItem(`${KEY}.current`, id);
  }

  add(message, model) {
    const conversation = this.current();
    if (!conversation.messages.includes(message)) conversation.messages.push(message);
    if (!conversation.title && message.role === "user") conversation.title = message.content.slice(0, 40) || "Image";
    conversation.model = model;
    conversation.updated = Date.now();
    this.save();
  }

  remove(id) {
    this.list = this.list.filter((c) => c.id !== id);
    if (this.currentId === id || !this.list.length) {
      if (this.list.length) this.select(this.all()[0].id);
      else this.create();
    }
    this.save();
  }

  save() {
    try {
      this.storage.setItem(KEY, JSON.stringify(this.list));
    } catch (_) {
      // Over the browser's quota: keep the words, drop the images of older messages.
      for (const c of this.list) for (const m of c.messages) delete m.images;
      try { this.storage.setItem(KEY, JSON.stringify(this.list)); } catch (_) { /* keep in memory */ }
    }
  }
}
