//! The text form of graphs (`.nir` files): printed by [`print`], read back by [`parse`].
//!
//! ```text
//! graph @name {
//!   %0 = input {name = "L"} : lengths[B]
//!   %1 = input {name = "x"} : ragged<f32>[B; %0, 512]
//!   %2 = softmax(%1) {axis = 1} : ragged<f32>[B; %0, 512]
//!   return %2
//! }
//! ```
//!
//! `//` starts a comment that runs to the end of the line (dumps put pass reports there).

use std::fmt::Write;

use thiserror::Error;

use crate::{Attr, DType, Dim, ElemDim, Graph, Node, Op, Type, ValueId};

/// Writes a graph in the text form (see [`parse`] for an example), which parses back
/// to the same graph.
pub fn print(graph: &Graph) -> String {
    let mut out = String::new();
    print_graph(graph, 0, &mut out);
    out
}

fn print_graph(graph: &Graph, indent: usize, out: &mut String) {
    let pad = "  ".repeat(indent);
    // Writing to a String cannot fail.
    let _ = writeln!(out, "graph @{} {{", graph_name(&graph.name));
    for (index, Node { op, ty }) in graph.nodes.iter().enumerate() {
        let _ = write!(out, "{pad}  %{index} = {}", op.name());
        let operands = op.operands();
        if !operands.is_empty() {
            let list: Vec<String> = operands.iter().map(ToString::to_string).collect();
            let _ = write!(out, "({})", list.join(", "));
        }
        let attrs = op.attrs();
        if !attrs.is_empty() {
            let list: Vec<String> = attrs
                .iter()
                .map(|(key, value)| format!("{key} = {value}"))
                .collect();
            let _ = write!(out, " {{{}}}", list.join(", "));
        }
        let _ = write!(out, " : {ty}");
        if let Op::PerElement { body, .. } = op {
            out.push(' ');
            print_graph(body, indent + 1, out);
        } else {
            out.push('\n');
        }
    }
    let outputs: Vec<String> = graph.outputs.iter().map(ToString::to_string).collect();
    let _ = writeln!(out, "{pad}  return {}", outputs.join(", "));
    let _ = writeln!(out, "{pad}}}");
}

/// Why a text could not be read as a graph: the line and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    /// 1-based line of the problem.
    pub line: usize,
    /// What was wrong.
    pub message: String,
}

/// Reads a graph written by [`print()`]; types are checked as the graph is built.
///
/// ```
/// let text = "\
/// graph @ffn {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
///   %2 = param {name = \"w\"} : f32[8, 4]
///   %3 = linear(%1, %2) : ragged<f32>[B; %0, 8]
///   %4 = relu(%3) : ragged<f32>[B; %0, 8]
///   return %4
/// }
/// ";
/// let graph = nestor_ir::parse(text)?;
/// assert_eq!(graph.nodes.len(), 5);
/// assert_eq!(nestor_ir::print(&graph), text);
/// // A declared type that inference disagrees with is an error naming the line.
/// let wrong = text.replace("ragged<f32>[B; %0, 8]\n  %4", "ragged<f32>[B; %0, 9]\n  %4");
/// assert_eq!(nestor_ir::parse(&wrong).unwrap_err().line, 5);
/// # Ok::<(), nestor_ir::ParseError>(())
/// ```
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    let tokens = tokenize(text)?;
    let mut parser = Parser {
        tokens,
        position: 0,
        depth: 0,
    };
    let graph = parser.graph()?;
    if let Some(token) = parser.tokens.get(parser.position) {
        return Err(ParseError {
            line: token.line,
            message: format!("unexpected {:?} after the graph", token.kind),
        });
    }
    Ok(graph)
}

#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Word(String),
    Value(u32),
    Number(String),
    Str(String),
    Punct(char),
}

#[derive(Clone, Debug)]
struct Token {
    kind: Kind,
    line: usize,
}

/// Writes `text` as a quoted string the tokenizer reads back: `\\` and `\"` escaped,
/// control characters as `\u{..}`, everything else as it is.
pub(crate) fn quote(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('"');
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                quoted.push('\\');
                quoted.push(c);
            }
            c if c.is_control() => quoted.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// The character an escape after `\\` stands for, and how many characters it took:
/// `\\`, `\"`, `\n`, `\t`, `\r`, `\0` and `\u{hex}`.
fn unescape(chars: &[char]) -> Option<(char, usize)> {
    match chars.first()? {
        'n' => Some(('\n', 1)),
        't' => Some(('\t', 1)),
        'r' => Some(('\r', 1)),
        '0' => Some(('\0', 1)),
        'u' => {
            let close = chars.iter().position(|&c| c == '}')?;
            if chars.get(1) != Some(&'{') || close > 8 {
                return None;
            }
            let hex: String = chars[2..close].iter().collect();
            let code = u32::from_str_radix(&hex, 16).ok()?;
            Some((char::from_u32(code)?, close + 1))
        }
        &other => Some((other, 1)),
    }
}

fn tokenize(text: &str) -> Result<Vec<Token>, ParseError> {
    let mut tokens = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let (mut index, mut line) = (0, 1);
    while index < chars.len() {
        let c = chars[index];
        let error = |message: String| ParseError { line, message };
        if c == '\n' {
            line += 1;
            index += 1;
        } else if c.is_whitespace() {
            index += 1;
        } else if c == '/' && chars.get(index + 1) == Some(&'/') {
            // A comment runs to the end of the line.
            while index < chars.len() && chars[index] != '\n' {
                index += 1;
            }
        } else if c == '%' {
            let start = index + 1;
            index = start;
            while index < chars.len() && chars[index].is_ascii_digit() {
                index += 1;
            }
            let digits: String = chars[start..index].iter().collect();
            let value = digits
                .parse()
                .map_err(|_| error(format!("bad value name %{digits}")))?;
            tokens.push(Token {
                kind: Kind::Value(value),
                line,
            });
        } else if c == '"' {
            let mut value = String::new();
            index += 1;
            loop {
                match chars.get(index) {
                    None => return Err(error("unterminated string".into())),
                    Some('"') => break,
                    Some('\\') => {
                        index += 1;
                        let (escaped, length) = unescape(&chars[index..])
                            .ok_or_else(|| error("bad escape in a string".into()))?;
                        value.push(escaped);
                        index += length - 1;
                    }
                    Some(&other) => value.push(other),
                }
                index += 1;
            }
            index += 1;
            tokens.push(Token {
                kind: Kind::Str(value),
                line,
            });
        } else if c.is_ascii_digit()
            || (c == '-'
                && chars
                    .get(index + 1)
                    .is_some_and(|n| n.is_ascii_digit() || *n == 'i'))
        {
            let start = index;
            index += 1;
            while index < chars.len()
                && (chars[index].is_ascii_alphanumeric() || ".+-".contains(chars[index]))
            {
                // A sign only continues a number right after an exponent.
                if "+-".contains(chars[index]) && !matches!(chars[index - 1], 'e' | 'E') {
                    break;
                }
                index += 1;
            }
            tokens.push(Token {
                kind: Kind::Number(chars[start..index].iter().collect()),
                line,
            });
        } else if c.is_alphabetic() || c == '_' {
            let start = index;
            while index < chars.len()
                && (chars[index].is_alphanumeric() || chars[index] == '_' || chars[index] == '.')
            {
                index += 1;
            }
            tokens.push(Token {
                kind: Kind::Word(chars[start..index].iter().collect()),
                line,
            });
        } else if "{}()[]<>;,=:@?".contains(c) {
            tokens.push(Token {
                kind: Kind::Punct(c),
                line,
            });
            index += 1;
        } else {
            return Err(error(format!("unexpected character {c:?}")));
        }
    }
    Ok(tokens)
}

struct Parser {
    tokens: Vec<Token>,
    position: usize,
    /// How many graphs enclose the one being read (per-element bodies nest).
    depth: usize,
}

/// How deep per-element bodies may nest in a text (deeper texts are an error, not a
/// stack overflow; real graphs nest one level).
pub const MAX_NESTING: usize = 16;

impl Parser {
    fn line(&self) -> usize {
        self.tokens
            .get(self.position)
            .or(self.tokens.last())
            .map_or(1, |token| token.line)
    }

    fn error<T>(&self, message: impl Into<String>) -> Result<T, ParseError> {
        Err(ParseError {
            line: self.line(),
            message: message.into(),
        })
    }

    fn peek(&self) -> Option<&Kind> {
        self.tokens.get(self.position).map(|token| &token.kind)
    }

    fn next(&mut self) -> Result<Kind, ParseError> {
        let token = self.tokens.get(self.position).cloned();
        self.position += 1;
        match token {
            Some(token) => Ok(token.kind),
            None => self.error("unexpected end of text"),
        }
    }

    fn punct(&mut self, expected: char) -> Result<(), ParseError> {
        match self.next()? {
            Kind::Punct(c) if c == expected => Ok(()),
            other => self.error(format!("expected {expected:?}, got {other:?}")),
        }
    }

    fn eat(&mut self, expected: char) -> bool {
        if self.peek() == Some(&Kind::Punct(expected)) {
            self.position += 1;
            true
        } else {
            false
        }
    }

    fn word(&mut self) -> Result<String, ParseError> {
        match self.next()? {
            Kind::Word(word) => Ok(word),
            other => self.error(format!("expected a word, got {other:?}")),
        }
    }

    fn value(&mut self) -> Result<ValueId, ParseError> {
        match self.next()? {
            Kind::Value(value) => Ok(ValueId(value)),
            other => self.error(format!("expected a value like %3, got {other:?}")),
        }
    }

    fn graph(&mut self) -> Result<Graph, ParseError> {
        if self.word()? != "graph" {
            return self.error("expected `graph`");
        }
        self.punct('@')?;
        // A name that is not a word (a space in it) is quoted.
        let name = match self.next()? {
            Kind::Word(name) | Kind::Str(name) => name,
            other => return self.error(format!("expected a graph name, got {other:?}")),
        };
        let mut graph = Graph::new(name);
        self.punct('{')?;
        loop {
            match self.next()? {
                Kind::Word(word) if word == "return" => break,
                Kind::Value(value) => self.node(&mut graph, value)?,
                other => {
                    return self.error(format!(
                        "expected a value definition or `return`, got {other:?}"
                    ))
                }
            }
        }
        while let Some(Kind::Value(_)) = self.peek() {
            let output = self.value()?;
            graph.outputs.push(output);
            if !self.eat(',') {
                break;
            }
        }
        self.punct('}')?;
        graph.verify().map_err(|error| ParseError {
            line: self.line(),
            message: error.to_string(),
        })?;
        Ok(graph)
    }

    fn node(&mut self, graph: &mut Graph, value: u32) -> Result<(), ParseError> {
        // The definition's own line (the `%N` token was just read).
        let line = self
            .tokens
            .get(self.position.saturating_sub(1))
            .map_or(1, |token| token.line);
        if value as usize != graph.nodes.len() {
            return self.error(format!(
                "expected %{} next, got %{value}",
                graph.nodes.len()
            ));
        }
        self.punct('=')?;
        let name = self.word()?;
        let mut operands = Vec::new();
        if self.eat('(') {
            loop {
                operands.push(self.value()?);
                if !self.eat(',') {
                    break;
                }
            }
            self.punct(')')?;
        }
        let mut attrs = Vec::new();
        if self.eat('{') {
            loop {
                let key = self.word()?;
                self.punct('=')?;
                attrs.push((key, self.attr()?));
                if !self.eat(',') {
                    break;
                }
            }
            self.punct('}')?;
        }
        self.punct(':')?;
        let ty = self.ty()?;
        let body = if matches!(self.peek(), Some(Kind::Word(word)) if word == "graph") {
            if self.depth >= MAX_NESTING {
                return self.error(format!(
                    "per-element bodies nest deeper than {MAX_NESTING} levels"
                ));
            }
            self.depth += 1;
            let body = self.graph();
            self.depth -= 1;
            Some(body?)
        } else {
            None
        };
        let op = Op::from_parts(&name, &operands, &attrs, body)
            .map_err(|message| ParseError { line, message })?;
        let result = if op.declares_type() {
            graph.add_declared(op, ty.clone())
        } else {
            graph.push(op)
        };
        let added = result.map_err(|error| ParseError {
            line,
            message: error.to_string(),
        })?;
        if graph.ty(added) != &ty {
            return Err(ParseError {
                line,
                message: format!(
                    "{added} is declared {ty} but its op gives {}",
                    graph.ty(added)
                ),
            });
        }
        Ok(())
    }

    fn attr(&mut self) -> Result<Attr, ParseError> {
        match self.next()? {
            Kind::Number(text) => self.number(&text),
            Kind::Str(value) => Ok(Attr::Str(value)),
            Kind::Word(word) => Ok(match word.as_str() {
                "true" => Attr::Bool(true),
                "false" => Attr::Bool(false),
                "inf" | "NaN" => Attr::Float(word.parse().unwrap_or(f64::NAN)),
                _ => Attr::Word(word),
            }),
            Kind::Punct('[') => {
                let mut values = Vec::new();
                if !self.eat(']') {
                    loop {
                        match self.next()? {
                            Kind::Number(text) => match text.parse() {
                                Ok(value) => values.push(value),
                                Err(_) => {
                                    return self.error(format!("expected an integer, got {text}"))
                                }
                            },
                            other => {
                                return self.error(format!("expected an integer, got {other:?}"))
                            }
                        }
                        if !self.eat(',') {
                            break;
                        }
                    }
                    self.punct(']')?;
                }
                Ok(Attr::Ints(values))
            }
            other => self.error(format!("expected an attribute value, got {other:?}")),
        }
    }

    fn number(&self, text: &str) -> Result<Attr, ParseError> {
        if let Ok(value) = text.parse::<i64>() {
            return Ok(Attr::Int(value));
        }
        match text.parse::<f64>() {
            Ok(value) => Ok(Attr::Float(value)),
            Err(_) => self.error(format!("bad number {text}")),
        }
    }

    fn dim(&mut self) -> Result<Dim, ParseError> {
        match self.next()? {
            Kind::Number(text) => match text.parse() {
                Ok(size) => Ok(Dim::Static(size)),
                Err(_) => self.error(format!("bad size {text}")),
            },
            Kind::Word(word) if word == "max" => {
                self.punct('(')?;
                let lengths = self.value()?;
                self.punct(')')?;
                Ok(Dim::Max(lengths))
            }
            Kind::Word(word) => Ok(Dim::Sym(word)),
            Kind::Punct('?') => Ok(Dim::Sym("?".into())),
            other => self.error(format!("expected a dim, got {other:?}")),
        }
    }

    fn dims_until(&mut self, end: char) -> Result<Vec<ElemDim>, ParseError> {
        let mut dims = Vec::new();
        if self.eat(end) {
            return Ok(dims);
        }
        loop {
            if let Some(Kind::Value(_)) = self.peek() {
                dims.push(ElemDim::Ragged(self.value()?));
            } else {
                dims.push(ElemDim::Fixed(self.dim()?));
            }
            if !self.eat(',') {
                break;
            }
        }
        self.punct(end)?;
        Ok(dims)
    }

    fn ty(&mut self) -> Result<Type, ParseError> {
        let word = self.word()?;
        match word.as_str() {
            "lengths" => {
                self.punct('[')?;
                let batch = self.dim()?;
                self.punct(']')?;
                Ok(Type::Lengths { batch })
            }
            "ragged" => {
                self.punct('<')?;
                let dtype = self.dtype()?;
                self.punct('>')?;
                self.punct('[')?;
                let batch = self.dim()?;
                self.punct(';')?;
                let dims = self.dims_until(']')?;
                Ok(Type::Ragged { dtype, batch, dims })
            }
            name => {
                let dtype = DType::from_name(name)
                    .map_or_else(|| self.error(format!("unknown dtype {name}")), Ok)?;
                self.punct('[')?;
                let dims = self.dims_until(']')?;
                let shape =
                    dims.into_iter()
                        .map(|dim| match dim {
                            ElemDim::Fixed(dim) => Ok(dim),
                            ElemDim::Ragged(value) => self
                                .error(format!("a dense shape cannot hold the ragged dim {value}")),
                        })
                        .collect::<Result<_, _>>()?;
                Ok(Type::Dense { dtype, shape })
            }
        }
    }

    fn dtype(&mut self) -> Result<DType, ParseError> {
        let name = self.word()?;
        DType::from_name(&name).map_or_else(|| self.error(format!("unknown dtype {name}")), Ok)
    }
}

/// A graph's name as the text writes it: as it is when it reads back as one word, else
/// quoted (`@"inner dims"`).
fn graph_name(name: &str) -> std::borrow::Cow<'_, str> {
    let mut chars = name.chars();
    let word = chars
        .next()
        .is_some_and(|first| first.is_alphabetic() || first == '_')
        && chars.all(|c| c.is_alphanumeric() || c == '_' || c == '.');
    match word {
        true => name.into(),
        false => quote(name).into(),
    }
}
