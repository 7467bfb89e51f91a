// Renders a parsed template: statements write to the output, expressions evaluate with Python's
// semantics and jinja2's scoping (each loop iteration and macro call is a new scope; `set` inside
// one does not leak out, which is why templates use namespace()).
#include <cmath>
#include <new>

#include "qlora/jinja/ast.h"
#include "qlora/jinja/builtins.h"
#include "qlora/jinja/operators.h"
#include "qlora/jinja/template.h"

namespace qlora::jinja {

namespace {

struct Frame;
using FramePtr = std::shared_ptr<Frame>;

struct Frame {
  FramePtr parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(const std::string& name) const {
    for (const Frame* f = this; f; f = f->parent.get()) {
      for (const auto& [k, v] : f->vars) {
        if (k == name) return &v;
      }
    }
    return nullptr;
  }
  void set(const std::string& name, Value value) {
    for (auto& [k, v] : vars) {
      if (k == name) {
        v = std::move(value);
        return;
      }
    }
    vars.emplace_back(name, std::move(value));
  }
};

FramePtr child(const FramePtr& parent) {
  auto f = std::make_shared<Frame>();
  f->parent = parent;
  return f;
}

// A library's own words (std::bad_alloc) say nothing to the user; ours do.
std::string message(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e)) return "out of memory reading or rendering the template";
  return e.what();
}

class Renderer {
 public:
  Renderer(const Program& program, const RenderOptions& options) : program_(program), options_(options) {}

  Rendered run(const nlohmann::ordered_json& context) {
    if (!context.is_object()) throw TemplateError(program_.origin + ": the render context must be a JSON object");
    auto globals = std::make_shared<Frame>();
    Value builtins = make_globals(options_.now_unix_seconds);  // kept alive: the loop reads its dict
    for (auto& [k, v] : builtins.dict->items) globals->set(k, v);
    FramePtr root = child(globals);
    for (const auto& [k, v] : context.items()) root->set(k, from_json(v));
    BudgetScope budget(options_.budget);
    out_ = &result_.text;
    exec_body(program_.body, root);
    result_.steps_used = budget.steps;
    result_.bytes_used = budget.bytes;
    return std::move(result_);
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  std::string where(int line, int col) const {
    return program_.origin + ":" + std::to_string(line) + ":" + std::to_string(col);
  }

  Flow exec_body(const Body& body, const FramePtr& frame) {
    for (const StmtPtr& s : body) {
      Flow flow = exec(*s, frame);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  // Errors from builtins get this statement's location; errors already located pass through.
  Flow exec(const Stmt& s, const FramePtr& frame) {
    try {
      budget_steps(1);
      return exec_unlocated(s, frame);
    } catch (const TemplateError&) {
      throw;
    } catch (const std::exception& e) {
      throw TemplateError(where(s.line, s.col) + ": " + message(e));
    }
  }

  // Appends to the current output, which is one string under the budget's one-string limit.
  void emit(const std::string& text) {
    budget_append(out_->size(), text.size());
    *out_ += text;
  }

  static size_t string_bytes(const Value& v) { return v.is_string() ? v.s.size() : 0; }

  Flow exec_unlocated(const Stmt& s, const FramePtr& frame) {
    switch (s.kind) {
      case StmtKind::kText: emit(s.text); return Flow::kNormal;
      case StmtKind::kOutput: {
        Value v = eval(*s.expr, frame);
        if (v.generator) throw std::runtime_error("printing a generator (map/select/items...) is outside the subset; add |list");
        emit(to_str(v));
        return Flow::kNormal;
      }
      case StmtKind::kIf:
        for (const auto& [condition, body] : s.branches) {
          if (!condition || truthy(eval(*condition, frame))) return exec_body(body, frame);
        }
        return Flow::kNormal;
      case StmtKind::kFor: exec_for(s, frame); return Flow::kNormal;
      case StmtKind::kSet: assign(s, eval(*s.expr, frame), frame); return Flow::kNormal;
      case StmtKind::kSetBlock: assign(s, Value::string(capture(s.body, child(frame))), frame); return Flow::kNormal;
      case StmtKind::kMacro: define_macro(s, frame); return Flow::kNormal;
      case StmtKind::kCallBlock: emit(to_str(call_block(s, frame))); return Flow::kNormal;
      case StmtKind::kFilterBlock: {
        Value saved = filter_input_;
        filter_input_ = Value::string(capture(s.body, frame));
        Value v = eval(*s.expr, frame);
        filter_input_ = saved;
        emit(to_str(v));
        return Flow::kNormal;
      }
      case StmtKind::kBreak: return Flow::kBreak;
      case StmtKind::kContinue: return Flow::kContinue;
      case StmtKind::kGeneration: {
        // transformers: start = characters rendered so far at the top level, end = start + the
        // block's own length (here in bytes).
        std::string rv = capture(s.body, frame);
        size_t start = result_.text.size();
        result_.generation_spans.emplace_back(start, start + rv.size());
        emit(rv);
        return Flow::kNormal;
      }
    }
    return Flow::kNormal;
  }

  // Renders body into a string of its own (block set, macro, caller, filter, generation).
  std::string capture(const Body& body, const FramePtr& frame) {
    std::string buffer;
    std::string* saved = out_;
    out_ = &buffer;
    try {
      exec_body(body, frame);
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return buffer;
  }

  void bind_targets(const std::vector<std::string>& targets, const Value& value, Frame& frame) {
    if (targets.size() == 1) {
      frame.set(targets[0], value);
      return;
    }
    List items = iterate(value);
    if (items.size() != targets.size()) {
      throw std::runtime_error(items.size() < targets.size()
                                   ? "not enough values to unpack (expected " + std::to_string(targets.size()) + ", got " + std::to_string(items.size()) + ")"
                                   : "too many values to unpack (expected " + std::to_string(targets.size()) + ")");
    }
    for (size_t k = 0; k < targets.size(); ++k) frame.set(targets[k], items[k]);
  }

  void exec_for(const Stmt& s, const FramePtr& frame) {
    List all = iterate(eval(*s.expr, frame));
    List items;
    for (const Value& item : all) {  // the `if` filter sees the loop variables, not `loop`
      if (!s.condition) {
        items.push_back(item);
        continue;
      }
      FramePtr scope = child(frame);
      bind_targets(s.targets, item, *scope);
      if (truthy(eval(*s.condition, scope))) items.push_back(item);
    }
    if (items.empty()) {
      exec_body(s.else_body, child(frame));
      return;
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      // An iteration copies its item and loop.previtem / nextitem.
      budget_steps(1);
      budget_copied(string_bytes(items[k]) + (k > 0 ? string_bytes(items[k - 1]) : 0) +
                    (k + 1 < n ? string_bytes(items[k + 1]) : 0));
      FramePtr scope = child(frame);
      bind_targets(s.targets, items[k], *scope);
      scope->set("loop", loop_object(items, k));
      if (exec_body(s.body, scope) == Flow::kBreak) break;
    }
  }

  static Value loop_object(const List& items, int64_t k) {
    const int64_t n = static_cast<int64_t>(items.size());
    Value loop = Value::make_dict();
    Dict& d = *loop.dict;
    d.set("index", Value::integer(k + 1));
    d.set("index0", Value::integer(k));
    d.set("revindex", Value::integer(n - k));
    d.set("revindex0", Value::integer(n - k - 1));
    d.set("first", Value::boolean(k == 0));
    d.set("last", Value::boolean(k == n - 1));
    d.set("length", Value::integer(n));
    d.set("depth", Value::integer(1));
    d.set("depth0", Value::integer(0));
    if (k > 0) d.set("previtem", items[k - 1]);
    if (k + 1 < n) d.set("nextitem", items[k + 1]);
    d.set("cycle", Value::function("cycle", [k](Args& a) {
            if (a.positional.empty()) throw std::runtime_error("no items for cycling given");
            return a.positional[k % a.positional.size()];
          }));
    return loop;
  }

  void assign(const Stmt& s, const Value& value, const FramePtr& frame) {
    if (s.attribute.empty()) {
      bind_targets(s.targets, value, *frame);
      return;
    }
    const Value* ns = frame->find(s.targets[0]);
    if (!ns || ns->kind != Kind::kNamespace) throw std::runtime_error("cannot assign attribute on non-namespace object");
    if (s.attribute[0] == '_') {
      throw std::runtime_error("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
                               s.attribute + "'. Please rename the attribute.");
    }
    ns->dict->set(s.attribute, value);
  }

  void define_macro(const Stmt& s, const FramePtr& frame) {
    const Stmt* macro = &s;
    FramePtr defined_in = frame;
    frame->set(s.name, Value::function(s.name, [this, macro, defined_in](Args& a) {
                 return call_macro(*macro, defined_in, a);
               }));
  }

  // Arguments bind as Python's do; a parameter left without one is undefined. `caller` is the
  // body of a {% call %} block.
  Value call_macro(const Stmt& m, const FramePtr& defined_in, Args& a) {
    if (++depth_ > 200) throw std::runtime_error("macro recursion deeper than 200 calls");
    FramePtr scope = child(defined_in);
    if (a.positional.size() > m.params.size()) {
      throw std::runtime_error("macro '" + m.name + "' takes not more than " + std::to_string(m.params.size()) + " argument(s)");
    }
    std::vector<bool> bound(m.params.size(), false);
    for (size_t k = 0; k < a.positional.size(); ++k) {
      scope->set(m.params[k].name, a.positional[k]);
      bound[k] = true;
    }
    for (const auto& [key, value] : a.keyword) {
      size_t k = 0;
      while (k < m.params.size() && m.params[k].name != key) ++k;
      if (k < m.params.size()) {
        scope->set(key, value);
        bound[k] = true;
      } else if (key == "caller") {
        scope->set(key, value);
      } else {
        throw std::runtime_error("macro '" + m.name + "' takes no keyword argument '" + key + "'");
      }
    }
    for (size_t k = 0; k < m.params.size(); ++k) {
      if (bound[k]) continue;
      const Param& p = m.params[k];
      scope->set(p.name, p.default_value ? eval(*p.default_value, scope)
                                          : Value::undefined("'" + p.name + "' is undefined"));
    }
    std::string text = capture(m.body, scope);
    --depth_;
    return Value::string(text);
  }

  Value call_block(const Stmt& s, const FramePtr& frame) {
    const Stmt* block = &s;
    FramePtr here = frame;
    Value caller = Value::function("caller", [this, block, here](Args& a) {
      FramePtr scope = child(here);
      for (size_t k = 0; k < block->params.size(); ++k) {
        const Param& p = block->params[k];
        scope->set(p.name, k < a.positional.size() ? a.positional[k]
                           : p.default_value        ? eval(*p.default_value, scope)
                                                    : Value::undefined("'" + p.name + "' is undefined"));
      }
      return Value::string(capture(block->body, scope));
    });
    return call(*s.expr, frame, &caller);
  }

  Value call(const Expr& e, const FramePtr& frame, const Value* caller) {
    Value callee = eval(*e.children[0], frame);
    if (callee.is_undefined()) undefined_error(callee);
    if (callee.kind != Kind::kFunction) throw std::runtime_error(std::string("'") + type_name(callee) + "' object is not callable");
    Args args;
    for (size_t k = 1; k < e.children.size(); ++k) args.positional.push_back(eval(*e.children[k], frame));
    for (const auto& [key, value] : e.kwargs) args.keyword.emplace_back(key, eval(*value, frame));
    if (caller) args.keyword.emplace_back("caller", *caller);
    return callee.fn->call(args);
  }

  Args eval_args(const Expr& e, const FramePtr& frame) {
    Args args;
    for (size_t k = 1; k < e.children.size(); ++k) args.positional.push_back(eval(*e.children[k], frame));
    for (const auto& [key, value] : e.kwargs) args.keyword.emplace_back(key, eval(*value, frame));
    return args;
  }

  // Each expression is a step; a string it yields was built or copied (strings are values).
  Value eval(const Expr& e, const FramePtr& frame) {
    try {
      budget_steps(1);
      Value v = eval_unlocated(e, frame);
      budget_copied(string_bytes(v));
      return v;
    } catch (const TemplateError&) {
      throw;
    } catch (const RaiseSignal& r) {
      throw RaisedError(where(e.line, e.col), r.message);
    } catch (const std::exception& err) {
      throw TemplateError(where(e.line, e.col) + ": " + message(err));
    }
  }

  Value eval_unlocated(const Expr& e, const FramePtr& frame) {
    auto sub = [&](size_t k) { return eval(*e.children[k], frame); };
    switch (e.kind) {
      case ExprKind::kLiteral: return e.literal;
      case ExprKind::kName: {
        const Value* v = frame->find(e.name);
        return v ? *v : Value::undefined("'" + e.name + "' is undefined");
      }
      case ExprKind::kList:
      case ExprKind::kTuple: {
        List items;
        for (size_t k = 0; k < e.children.size(); ++k) items.push_back(sub(k));
        return e.kind == ExprKind::kList ? Value::make_list(std::move(items)) : Value::make_tuple(std::move(items));
      }
      case ExprKind::kDict: {
        Value d = Value::make_dict();
        for (size_t k = 0; k + 1 < e.children.size(); k += 2) {
          Value key = sub(k);
          if (!key.is_string()) throw std::runtime_error("dict keys other than strings are outside the subset");
          // Python would keep the key a Markup (its repr says so); our keys are plain strings.
          if (key.markup) throw std::runtime_error("Markup (|safe, |escape) dict keys are outside the subset");
          d.dict->set(key.s, sub(k + 1));
        }
        return d;
      }
      case ExprKind::kAttr: return get_attr(sub(0), e.name);
      case ExprKind::kItem: return get_item(sub(0), sub(1));
      case ExprKind::kSlice: {
        auto part = [&](size_t k) { return e.children[k] ? sub(k) : Value::none(); };
        return slice_of(sub(0), part(1), part(2), part(3));
      }
      case ExprKind::kCall: return call(e, frame, nullptr);
      case ExprKind::kFilter: {
        Value operand = e.children[0] ? sub(0) : filter_input_;
        Args args = eval_args(e, frame);
        return apply_filter(e.name, operand, args);
      }
      case ExprKind::kTest: {
        Value operand = sub(0);
        Args args = eval_args(e, frame);
        return Value::boolean(apply_test(e.name, operand, args) != e.negated);
      }
      case ExprKind::kNeg:
      case ExprKind::kPos: {
        Value v = sub(0);
        if (v.is_undefined()) undefined_error(v);
        if (!v.is_number()) throw std::runtime_error(std::string("bad operand type for unary ") + (e.kind == ExprKind::kNeg ? "-" : "+") + ": '" + type_name(v) + "'");
        if (e.kind == ExprKind::kPos) return v.kind == Kind::kBool ? Value::integer(v.b) : v;
        return v.kind == Kind::kFloat ? Value::real(-v.f) : Value::integer(-(v.kind == Kind::kInt ? v.i : v.b));
      }
      case ExprKind::kNot: return Value::boolean(!truthy(sub(0)));
      case ExprKind::kBinary: return binary_op(e.name, sub(0), sub(1));
      case ExprKind::kCompare: return compare_chain(e, frame);
      case ExprKind::kAnd: {
        Value left = sub(0);
        return truthy(left) ? sub(1) : left;
      }
      case ExprKind::kOr: {
        Value left = sub(0);
        return truthy(left) ? left : sub(1);
      }
      case ExprKind::kCond:
        if (truthy(sub(1))) return sub(0);
        return e.children[2] ? sub(2) : Value::undefined("the inline if expression's condition was false and it has no else");
    }
    return Value::undefined();
  }

  Value compare_chain(const Expr& e, const FramePtr& frame) {
    Value left = eval(*e.children[0], frame);
    for (size_t k = 0; k < e.ops.size(); ++k) {
      Value right = eval(*e.children[k + 1], frame);
      const std::string& op = e.ops[k];
      bool ok;
      if (op == "==") ok = equal(left, right);
      else if (op == "!=") ok = !equal(left, right);
      else if (op == "in") ok = contains(right, left);
      else if (op == "notin") ok = !contains(right, left);
      else {
        if (left.is_undefined()) undefined_error(left);
        if (right.is_undefined()) undefined_error(right);
        int c = compare(left, right);
        ok = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
      }
      if (!ok) return Value::boolean(false);
      left = std::move(right);
    }
    return Value::boolean(true);
  }

  const Program& program_;
  const RenderOptions& options_;
  Rendered result_;
  std::string* out_ = nullptr;
  Value filter_input_;
  int depth_ = 0;
};

}  // namespace

// Whatever escapes unlocated (a bad_alloc outside any statement) still names the template.
Template Template::parse(std::string_view source, std::string origin) {
  Template t;
  t.origin_ = std::move(origin);
  try {
    t.program_ = std::make_shared<Program>(parse_program(tokenize(source, t.origin_), t.origin_));
  } catch (const TemplateError&) {
    throw;
  } catch (const std::exception& e) {
    throw TemplateError(t.origin_ + ": " + message(e));
  }
  return t;
}

Rendered Template::render(const nlohmann::ordered_json& context, const RenderOptions& options) const {
  try {
    return Renderer(*program_, options).run(context);
  } catch (const TemplateError&) {
    throw;
  } catch (const std::exception& e) {
    throw TemplateError(origin_ + ": " + message(e));
  }
}

}  // namespace qlora::jinja
